"""The worker pool: rank processes, spawned once per session, on real process groups.

They run one Case at a time, forked from a warm zygote; a hang, a crash or a lost node becomes a verdict and the pool is rebuilt.
runner.py is the driver's side, worker.py the rank's, span.py the pool spread over torchrun nodes."""
