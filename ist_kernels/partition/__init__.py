"""Partition plans: which subnetwork owns which slice of the model in a round."""
