"""Leader election and fencing for blob masters (imported as ``blobha.leader``)."""

from blobha.leader.election import Deposed, LeaderElection, is_failure
from blobha.leader.history import LeaderHistory, Term

__all__ = ["Deposed", "LeaderElection", "LeaderHistory", "Term", "is_failure"]
