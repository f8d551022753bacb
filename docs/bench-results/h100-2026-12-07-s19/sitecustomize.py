# Device experiment only (not part of the package): process-wide torch settings from the environment, applied in
# every process of a run (bench, workers) before the daemon's code runs.
import os

if os.environ.get("EXP_CUDNN_BENCH") == "1" or os.environ.get("EXP_CONV1X1") == "1":
    import torch

    if os.environ.get("EXP_CUDNN_BENCH") == "1":
        torch.backends.cudnn.benchmark = True
    if os.environ.get("EXP_CONV1X1") == "1":
        import torch._inductor.config as c

        c.conv_1x1_as_mm = True
