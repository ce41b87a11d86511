"""Pure cost functions of embedding tables: on parameter servers, replicated on the GPUs, or split
across them.

Parameter-server mode (``plan.ps``, hyparallel/runtime/ps/) keeps the tables and the dense weights
on ``servers`` CPU processes. Each step, each of the dp workers pulls the rows its batch looks up
(one request per table and server) and every dense weight, runs forward and backward on its GPU, and
pushes the rows' gradients and the dense gradients (one request per server); the servers sum a
step's pushes and apply the optimizer. The alternatives keep the tables on the GPUs: replicated on
every one (data parallelism, priced by the search's own cost model) or split table-wise, each table
whole on one GPU and the pooled embeddings exchanged all-to-all each way (TorchRec's table-wise
sharding). These functions are small and pure, with units in their names;
``hyparallel.planner.tables`` puts them together. Formulas and assumptions: docs/cost-model.md,
"Embedding
tables: parameter servers or GPUs".
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from hyparallel.planner import costs
from hyparallel.spec.cluster import LinkSpec
from hyparallel.spec.schema import Dtype, PsOptimizer

# Tables, the rows pulled and the gradients pushed are fp32: the servers hold fp32 weights
# (hyparallel/runtime/ps/server.py keeps the model's parameters, which parallelize keeps in fp32)
# and a worker pulls rows in the table's dtype.
VALUE_BYTES = costs.MASTER_BYTES_PER_PARAM
# Each row asked for or pushed travels with its id, an int64 (the workers send torch.long row
# indices).
ROW_ID_BYTES = 8
# rowwise-adam keeps per row one fp32 second moment and an int64 count of the row's updates, besides
# an fp32 first moment per value (hyparallel/runtime/ps/optim.py: state "v" and "steps").
ROWWISE_ADAM_ROW_BYTES = 4 + 8

# Note [where the servers run]
#     The planner prices each server as a CPU process with a socket of its own: its own memory
#     bandwidth and host memory, and one GPU's share of the network (the cluster's inter_node link)
#     to the workers. Ray places the server actors where its cluster has room (RAY_ADDRESS names one
#     spanning CPU hosts); several on one socket share its bandwidth and memory, which these figures
#     do not see.
# SERVER_MEMORY_BANDWIDTH_BYTES_PER_S: one CPU socket's memory bandwidth as a server's row updates
# reach it. An AMD EPYC 7742 (the DGX A100's CPU) has 8 channels of DDR4-3200, 8 x 25.6 = 204.8 GB/s
# per socket (AMD's datasheet); STREAM reaches about 70% of that, and gathering and scattering rows
# of a few hundred bytes by index reaches less than streaming: 100 GB/s, about half of the peak, an
# estimate (measure a server's updates to replace it).
SERVER_MEMORY_BANDWIDTH_BYTES_PER_S = 100e9
# DEFAULT_SERVER_MEMORY_BYTES: host memory one server may fill when the cluster spec gives no
# ps_server_memory_bytes: one socket's half of the 1 TB of system memory a DGX A100 ships with
# (NVIDIA DGX A100 datasheet, 320 GB model; the 640 GB model has 2 TB), in GiB to stay below it.
DEFAULT_SERVER_MEMORY_BYTES = 512 * 2**30
# The round trip of one request to a server actor, whatever the link: Ray's own release
# microbenchmark (`single client tasks and get sync` / `1:1 actor calls sync`) runs about 2,000
# calls/s on a cloud VM, 0.5 ms a call; measured on this project's 2-core CI machine, a 16 KiB actor
# call takes 1.9 ms (Note [why Ray] in hyparallel/runtime/ps/actors.py). A cluster's collective
# latency (microseconds) is far below it.
RPC_REQUEST_S = 0.5e-3


def expected_unique_ids(rows: int, draws: float) -> float:
    """Distinct rows among ``draws`` lookups of a ``rows``-row table, as an upper bound.

    ``rows * (1 - (1 - 1/rows) ** draws)``, the expectation for uniform draws. Every draw
    distribution gives at most that many (each row's chance of being drawn, 1 - (1 - p) ** draws, is
    concave in its probability p, so the sum over rows is largest when every p is 1/rows), so
    Zipf-skewed click logs look up fewer: the planner over-prices what a batch moves rather than
    under-prices it.
    """
    if rows <= 0 or draws <= 0:
        return 0.0
    if rows == 1:
        return 1.0
    return rows * -math.expm1(draws * math.log1p(-1.0 / rows))


def optimizer_state_bytes(optimizer: PsOptimizer, values: float, rows: float) -> float:
    """Bytes of ``optimizer``'s state for ``rows`` rows holding ``values`` values in all
    (hyparallel/runtime/ps/optim.py): sgd none, adagrad one fp32 sum per value, rowwise-adam one
    fp32 first moment per value and ROWWISE_ADAM_ROW_BYTES per row."""
    if optimizer == "sgd":
        return 0.0
    if optimizer == "adagrad":
        return VALUE_BYTES * values
    return VALUE_BYTES * values + ROWWISE_ADAM_ROW_BYTES * rows


def update_traffic_bytes(optimizer: PsOptimizer, values: float, rows: float) -> float:
    """Memory traffic of applying one gradient to ``rows`` rows (``values`` values): the gradient
    read, the weights read and written, the optimizer's state read and written."""
    return 3 * VALUE_BYTES * values + 2 * optimizer_state_bytes(optimizer, values, rows)


def rows_bytes(rows: float, dim: int) -> float:
    """Bytes of ``rows`` rows of width ``dim`` on the wire, with their ids."""
    return rows * (dim * VALUE_BYTES + ROW_ID_BYTES)


def transfer_bytes(unique_rows: Sequence[float], dims: Sequence[int], dense_bytes: float) -> float:
    """Bytes one worker pulls per step (and as many it pushes): each table's distinct rows with
    their ids, and every dense weight (its gradient on the way back)."""
    return sum(rows_bytes(rows, dim) for rows, dim in zip(unique_rows, dims)) + dense_bytes


def server_table_memory_bytes(rows: int, dim: int, optimizer: PsOptimizer, servers: int) -> float:
    """Bytes of one table on the busiest of ``servers``: its ceil(rows / servers) rows (row r on
    server r % servers) and their optimizer state."""
    held = math.ceil(rows / servers)
    return held * dim * VALUE_BYTES + optimizer_state_bytes(optimizer, held * dim, held)


def dense_loads_bytes(tensor_bytes: Sequence[float], servers: int) -> list[float]:
    """Dense bytes on each of ``servers``: each tensor whole on one server, largest first onto the
    least loaded (lowest index on a tie), the rule hyparallel/runtime/ps/roles.py's dense_owners
    follows."""
    loads = [0.0] * servers
    # a heap of (load, index): its top is the next to fill
    lightest = [(0.0, server) for server in range(servers)]
    for size in sorted(tensor_bytes, reverse=True):
        load, server = heapq.heappop(lightest)
        loads[server] = load + size
        heapq.heappush(lightest, (loads[server], server))
    return loads


def pull_requests(unique_rows: Sequence[float], servers: int, dense_holders: int) -> int:
    """Round trips a worker waits for to pull one step's rows and dense weights, one after another:
    one per table (its requests to the servers holding its rows go out together,
    hyparallel.runtime.ps.remote) and one for the dense weights (to every server holding some,
    together)."""
    return sum(1 for rows in unique_rows if rows > 0) + (1 if dense_holders else 0)


def ps_link_s(worker_bytes: float, server_bytes: float, requests: int, link: LinkSpec) -> float:
    """Seconds of one direction of a step's traffic between the workers and the servers.

    Every worker sends or receives ``worker_bytes`` while the busiest server handles
    ``server_bytes`` (the sum of its part of every worker's), both on one device's share of
    ``link``, at once: the larger sets the time. Each of the worker's ``requests`` pays a round
    trip, one after another (a worker issues its calls in turn): the link's latency, or an RPC's
    (RPC_REQUEST_S), whichever is more.
    """
    round_trip_s = max(link.latency_s, RPC_REQUEST_S)
    return max(worker_bytes, server_bytes) / link.bandwidth_bytes_per_s + requests * round_trip_s


def server_update_s(
    update_bytes: float, received_bytes: float, served_bytes: float, bandwidth: float
) -> float:
    """Seconds the busiest server spends in memory per step: the optimizer's ``update_bytes``
    (update_traffic_bytes of the rows it updates), the pushes it received written on arrival and
    read when summed, and the rows and dense weights it served read and copied out; all at
    ``bandwidth`` (SERVER_MEMORY_BANDWIDTH_BYTES_PER_S)."""
    return (update_bytes + 2 * received_bytes + 2 * served_bytes) / bandwidth


def ps_step_s(compute_s: float, pull_s: float, push_s: float, update_s: float) -> float:
    """A synchronous (staleness 0) ps step: pull, forward and backward, push, then the servers'
    update; none of them can start before the one before it ends (the next pull reads the updated
    rows)."""
    return compute_s + pull_s + push_s + update_s


def server_memory_bytes(
    tables: Sequence[tuple[int, int]],
    dense_bytes: float,
    dense_rows: float,
    optimizer: PsOptimizer,
    servers: int,
    staged_bytes: float,
) -> float:
    """Host bytes of the busiest server: its rows of every (rows, dim) table with their state, its
    ``dense_bytes`` of dense weights (``dense_rows`` rows) with theirs, and the step's pushes it
    stages until the step closes."""
    table_bytes = sum(
        server_table_memory_bytes(rows, dim, optimizer, servers) for rows, dim in tables
    )
    dense_values = dense_bytes / VALUE_BYTES
    return (
        table_bytes
        + dense_bytes
        + optimizer_state_bytes(optimizer, dense_values, dense_rows)
        + staged_bytes
    )


def ps_worker_memory_bytes(
    dense_params: float, dtype: Dtype, pulled_values: float, activation_bytes: float
) -> float:
    """Bytes a ps worker's GPU holds at its peak: the dense weights in fp32 with autocast's 16-bit
    copy and their fp32 gradients (no optimizer state: the servers apply it), the pulled rows and
    their gradients, the activations."""
    copy = 0 if dtype == "fp32" else costs.DTYPE_BYTES[dtype]
    dense = dense_params * (costs.MASTER_BYTES_PER_PARAM + copy + costs.GRAD_BYTES_PER_PARAM)
    return dense + 2 * VALUE_BYTES * pulled_values + activation_bytes


def replicated_memory_bytes(table_params: float, bytes_per_param: float) -> float:
    """Bytes every GPU holds for the tables when they are replicated under data parallelism: each
    parameter's weights, gradient and optimizer state (``bytes_per_param``,
    costs.state_bytes_per_param's)."""
    return table_params * bytes_per_param


def table_wise_assignment(
    table_bytes: Sequence[float], table_dims: Sequence[int], devices: int
) -> list[int]:
    """The device of each table under a table-wise split (each table whole on one device).

    Largest table first, onto the device exchanging the fewest pooled values so far (the sum of its
    tables' dims, what its all-to-all carries), the one holding the fewest bytes on a tie: the large
    tables spread one per device, and the small ones even out the exchange without crowding memory.
    """
    dims, held = [0] * devices, [0.0] * devices
    assignment = [0] * len(table_bytes)
    for index in sorted(range(len(table_bytes)), key=lambda i: (-table_bytes[i], i)):
        device = min(range(devices), key=lambda d: (dims[d], held[d], d))
        assignment[index] = device
        dims[device] += table_dims[index]
        held[device] += table_bytes[index]
    return assignment


def table_wise_exchange_bytes(
    device_dims: int, total_dims: int, global_batch: int, devices: int
) -> float:
    """Bytes one device sends or receives (the larger) in one direction of a table-wise all-to-all.

    It sends its tables' pooled rows (``device_dims`` values per sample) for the other devices'
    samples and receives the other tables' (``total_dims - device_dims``) for its own global_batch /
    devices samples.
    """
    others = (devices - 1) / devices
    sent = global_batch * others * device_dims * VALUE_BYTES
    received = global_batch / devices * (total_dims - device_dims) * VALUE_BYTES
    return max(sent, received)


def all_to_all_s(num_bytes: float, group_size: int, link: LinkSpec) -> float:
    """An all-to-all in which the busiest rank moves ``num_bytes``: its bytes at the link's
    bandwidth and one latency per peer (pairwise exchange)."""
    if group_size == 1 or num_bytes <= 0:
        return 0.0
    return num_bytes / link.bandwidth_bytes_per_s + (group_size - 1) * link.latency_s


def device_update_s(
    update_bytes: float, memory_bandwidth_bytes_per_s: float, memory_efficiency: float
) -> float:
    """Seconds of a GPU's fused table update (TorchRec-style: rows updated in the backward, no dense
    gradient): its ``update_bytes`` at the device's memory bandwidth."""
    return update_bytes / (memory_bandwidth_bytes_per_s * memory_efficiency)
