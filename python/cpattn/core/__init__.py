"""The core every other layer builds on: loading the compiled module (`loader`), the ops' fake
kernels and autograd (`ops`, `autograd`), the cross-rank agreement check (`agreement`), argument
checks and environment variables (`validation`), layouts (`layout`), the options object
(`options`), host-to-device copies (`device`), the FLOP convention (`flops`) and the CPU's
description for benchmarks (`machine`). Nothing here imports a strategy."""
