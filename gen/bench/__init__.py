"""gen bench: batch sweeps against FP16 and other INT4 kernels, with clocks, energy and reports."""
