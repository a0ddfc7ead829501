"""stagewise: one large language model across several GPUs, processes and machines."""

__version__ = "0.1.0"
