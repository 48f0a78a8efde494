"""Run a script unchanged under replica groups, held once in one group just before it asks for a quorum, so that a
test's kill of another group lands at a known point of the survivor's loop on any machine:

    unified-dist launch --replica-groups N ... hold_before_quorum.py MARKER GROUP STEP SCRIPT [ARGS...]

Once group GROUP (on its first start) has committed STEP steps, its rank 0 writes ``MARKER.held`` right before it
would ask the lighthouse for the next step's quorum, and every rank of it waits there until ``MARKER.go`` exists;
then the step goes on as usual. Held there, the group has no quorum request pending (a request sent before a hold
is answered as soon as the killed group's heartbeat expires, with the survivor alone) and still sends heartbeats
(torchft's own thread), so the lighthouse gives its next quorum to it and the restarted group together. The
script is run as ``__main__`` with its own ``sys.argv``.
"""
import os
import runpy
import sys
import time

from unified_dist.backends import replica_groups

marker, group, after, script, *rest = sys.argv[1:]
asking = replica_groups.ReplicaGroups.begin_step
held = []


def begin_step(self) -> None:
    if (not held and not self.opened and self.layout.group == int(group) and self.layout.restarts == 0
            and self.manager.current_step() >= int(after)):
        held.append(True)
        if self.rank == 0:
            open(f"{marker}.held", "w").close()
        while not os.path.exists(f"{marker}.go"):
            time.sleep(0.02)
    asking(self)


replica_groups.ReplicaGroups.begin_step = begin_step
sys.argv = [script, *rest]
runpy.run_path(script, run_name="__main__")
