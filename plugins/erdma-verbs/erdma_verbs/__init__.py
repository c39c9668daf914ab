"""RDMA verbs for eRDMA (work in progress: the queue-pair layer and its test guest; no transport is
registered yet, so ``transport = "verbs"`` is still refused by the core with a hint to install this)."""
