"""One rank's step: the persistent input batch, host-to-device staging, the forward and sampling
(model_runner.py), CUDA graphs and the KV cache's memory sizing."""
