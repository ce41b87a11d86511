"""What users run around training: calibration (``calibrate``), the parity check (``parity``,
``hp.check``), plan views and pictures, the demo, the reference pages' generator (``docgen``) and
the dlrover-run shim.
"""
