"""Deciding and executing a call: plan.py asks each route whether it can run a pass and makes
the one plan of that pass; launch.py executes plans (forward -> Saved, backward -> Gradients)
through the executors and our Triton kernels."""
