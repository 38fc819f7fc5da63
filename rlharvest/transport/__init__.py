"""Process boundaries: one module per backend, all implementing ``transport.base``."""
