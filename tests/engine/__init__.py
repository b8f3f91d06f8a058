"""engine/: the model runtime against transformers on tiny checkpoints, allocator, scheduler, kernels."""
