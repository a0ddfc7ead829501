"""Transports between pipeline stages: frames over TCP, shared-memory and CUDA IPC rings, torch.distributed."""
