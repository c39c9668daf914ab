# The core's collective tests over transport "verbs" on 4 ranks: collectives.sh PYTHON CHECKOUT. Every
# collective x dtype x reduce op; of allreduce's algorithms ring and halving_doubling (tests/guest's
# conformance suite runs every allreduce algorithm on 3 ranks, with both completion modes, and a 2-rank
# exchange): each case under emulation costs a core for tens of seconds on a busy host. torch is imported
# once before the ranks fork (half a minute under emulation), for the cases that pass torch tensors and
# bfloat16. Completions through the completion channel: 4 ranks polling on the guest's 2 emulated cores take
# a quarter longer (the conformance tests in tests/guest run both ways). A test's call on its world is bounded
# by 600 s rather than 120 (PYTEST_ERDMA_TIMEOUT): the 4-rank ring allreduce's case list took 207 s in one CI
# run with the host busy beside it.
cd "$2"
ERDMA_TRANSPORT=verbs ERDMA_TRANSPORT_VERBS_COMPLETION=channel PYTEST_ERDMA_WORLDS=4 PYTEST_ERDMA_TIMEOUT=600 exec "$1" -c "
import sys
import torch
import pytest
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:randomly', '--durations=5', 'tests/test_collectives.py',
                      '-k', 'not (test_allreduce and (recursive_doubling or tree or parameter_server))']))
"
