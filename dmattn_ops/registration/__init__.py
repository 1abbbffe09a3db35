"""What torch.library knows of the ops: the schemas, fake kernels, autograd and autocast
(ops.py), vmap rules (batching.py), the rules that trace the kernels into compiled graphs
(inductor.py), and the one reading of a call by argument name (calls.py)."""
