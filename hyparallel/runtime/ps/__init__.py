"""Parameter-server mode: embedding tables on server processes, asynchronous SGD, elastic workers.

``hp.parallelize(model, plan)`` with a plan's ``ps`` section returns a :class:`PSServer` or a
:class:`PSWorker` (hyparallel.runtime.ps.roles). Importing this package does not import Ray;
starting a role does.
"""

from hyparallel.runtime.ps.dispatcher import Dispatcher
from hyparallel.runtime.ps.optim import RowOptimizer
from hyparallel.runtime.ps.server import Push, ServerShard

__all__ = ["Dispatcher", "Push", "RowOptimizer", "ServerShard"]
