"""``torchrun`` as the tests start it: torch.distributed.run's own entry point, run unchanged, with Python's cyclic
GC off while it imports torch, as the training scripts import it.

    python tests/helpers/torchrun.py --standalone --nproc_per_node=2 TRAIN_SCRIPT ARGS...

is ``torchrun --standalone --nproc_per_node=2 TRAIN_SCRIPT ARGS...``: the same argument parsing, agent, rendezvous,
signal forwarding and exit codes. The agent's import of torch takes about 0.7 s less CPU time (2.1-2.2 s of user
time instead of 2.9 s on the 2-core CI machine) in every launch the tests make themselves; the launch scripts in
scripts/, which test_launchers.py and test_slurm.py run, start the ``torchrun`` command itself.
"""

import gc

gc.disable()
from torch.distributed.run import main  # noqa: E402

gc.freeze()
gc.enable()

if __name__ == "__main__":
    main()
