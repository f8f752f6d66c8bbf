"""The deepspeed target: run scenarios on real DeepSpeed, trace them, compare with PyTorch."""
