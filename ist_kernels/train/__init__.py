"""Training: data sets, the simulated and distributed trainers of independent subnetworks."""
