"""Tools that study and steer compiled programs, built on the compiler's public names.

sim.py          fbmt.simulate: a program replayed on a machine cost model (Machine, H200)
calibration.py  fbmt.calibrate: this machine measured into a Machine profile
profiling.py    fbmt.profile: a compiled program's nodes timed on a real run
viz.py          fbmt.viz: timelines, memory curves, collective tables, block graphs
auto_remat.py   remat="auto"'s search: each block's recompute under a memory budget, simulated
"""
