"""Drop-in modules over ist_kernels.functional."""
