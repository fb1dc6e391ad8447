"""Ending a DDP process group must not deadlock however the last references to it are dropped."""

from __future__ import annotations

import sys
import textwrap

from processes import free_port, run_together

# Each round: a gloo group, a DDP model that ran a backward, an all_gather_object (the handoff's last
# collective), the group destroyed, then the model dropped. Without release_reducer the reducer's C++
# reference is the group's last, and gloo's destructor can join its threads holding the GIL while one of
# them waits for the GIL to free the gather's tensors: the process hangs (half the runs of 6 rounds did, here).
SCRIPT = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel
    from strategies.process_group import release_reducer

    def rounds(rank, port):
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
        for i in range(10):
            dist.init_process_group("gloo", store=dist.PrefixStore(f"round{i}", store), rank=rank, world_size=2)
            model = DistributedDataParallel(torch.nn.Linear(4, 2))
            model(torch.randn(3, 4)).sum().backward()
            dist.all_gather_object([None, None], {"weights": torch.ones(3), "round": i})
            release_reducer(model)
            dist.destroy_process_group()
            del model

    mp.start_processes(rounds, args=(int(sys.argv[1]),), nprocs=2, start_method="fork")
    print("all rounds ended")
""")


def test_a_ddp_model_dropped_after_its_group_is_destroyed_does_not_deadlock():
    [(status, output)] = run_together([[sys.executable, "-c", SCRIPT, str(free_port())]], timeout=90)
    assert status == 0 and "all rounds ended" in output, output  # a hang ends "[killed: still running ...]"
