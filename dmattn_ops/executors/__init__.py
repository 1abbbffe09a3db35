"""What runs a route, each module answering for its own: PyTorch's fused kernels (sdpa.py) and
cuDNN's window graphs (cudnn_graphs.py), the Hopper Gluon kernels (hopper.py), the tile tables and
key lists our Triton kernels step over (tiles.py), and the chunked PyTorch implementation
(chunked.py); _triton.py reaches the kernels of dmattn_ops.kernels, _alloc.py allocates. They
import the core values and each other, never the planner above them."""
