"""Test-wide settings. Without a GPU, numba's kernels run under its CUDA simulator (set before
numba is first imported); on a GPU machine the same kernel tests run on the GPU."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

# The simulator's default machine is this host's calibrated profile where one was saved; the tests
# compare against the fixed H200 profile, wherever they run (a test that needs a profile sets its own).
os.environ["FBMT_MACHINE"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "no-machine-profile.json")

# The compile cache is on, as it is for users, in a folder of this session's own: tests that compile a
# model another test compiled load its program, so the whole suite runs through the cache's loaded
# programs as well as compiled ones, and nothing is read from or left in the user's ~/.cache.
if "FBMT_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["FBMT_CACHE_DIR"] = tempfile.mkdtemp(prefix="fbmt-test-cache-")
    atexit.register(shutil.rmtree, os.environ["FBMT_CACHE_DIR"], True)
