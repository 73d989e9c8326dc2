"""Developer tools for the kernels: a pure-torch emulation of each kernel and GPU check scripts."""
