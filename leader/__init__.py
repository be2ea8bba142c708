"""Leader election and fencing for blob masters (imported as ``blobha.leader``)."""

from blobha.leader.election import Deposed, LeaderElection
from blobha.leader.history import LeaderHistory, Term

__all__ = ["Deposed", "LeaderElection", "LeaderHistory", "Term"]
