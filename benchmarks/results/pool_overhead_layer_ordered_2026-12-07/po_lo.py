"""pool_overhead.py from $ROOT (a checkout), its pools layer-ordered when LO=1: an engine that also copies subsets of layers, and the tiny format with 2 layers (a load splits by layer only over more than one). Run from the repository root:

    ROOT=. LO=1 python benchmarks/results/pool_overhead_layer_ordered_2026-12-07/po_lo.py --sections full,threads
"""
import os, sys
root = os.environ["ROOT"]
sys.path.insert(0, os.path.join(root, "benchmarks")); sys.path.insert(0, root)
import pool_overhead as P
import kvtier; assert kvtier.__file__.startswith(os.path.abspath(root)), kvtier.__file__
if os.environ.get("LO") == "1":
    P.NoCopyEngine.reloads_layers = True
    P.NoCopyEngine.reload_layers = lambda self, h, d, layers, ready=None: P.NoCopyEngine.reload(self, h, d, ready)
    P.POOL_OPTIONS["layer_ordered_loads"] = True
    P.TINY = dict(P.TINY, num_layers=2)  # a load splits by layer only over more than one layer
sys.argv = ["pool_overhead.py"] + sys.argv[1:]
P.main()
