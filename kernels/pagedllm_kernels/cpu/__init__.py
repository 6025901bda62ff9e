"""C++ CPU kernels, compiled on first use with torch's JIT extension builder (needs g++ and ninja)."""
