"""The example eRDMA plugin of docs/plugins.md: a Unix-socket transport, a float16 compressor, an allgather."""
