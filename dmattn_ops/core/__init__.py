"""The values every layer shares, importing nothing else of the package: the call as a Problem
and its Options (problem.py), the key band (band.py), how mask and bias operands are read
(operands.py), kernel options and switches (options.py, switches.py), tile configurations and
the shared-memory model (configs.py), argument checks (validate.py), sizes and device facts
(device.py), and what differs between PyTorch versions (_compat.py)."""
