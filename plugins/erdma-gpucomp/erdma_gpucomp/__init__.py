"""erdma-gpucomp: compressors for eRDMA's collectives (lossy casts, absmax quantization and top-k with error
feedback; lz4, zstd and nvcomp's codecs), on a CUDA GPU through cupy and nvcomp or on the CPU through numpy."""
