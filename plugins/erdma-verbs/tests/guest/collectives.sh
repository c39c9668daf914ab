# The core's collective tests over transport "verbs" on 2 and 4 ranks: collectives.sh PYTHON CHECKOUT.
# torch is imported once before the ranks fork (half a minute under emulation), for the cases that pass
# torch tensors and bfloat16. Completions through the completion channel: 4 ranks polling on the guest's 2
# emulated cores take a quarter longer (the conformance tests in tests/guest run both ways).
cd "$2"
ERDMA_TRANSPORT=verbs ERDMA_TRANSPORT_VERBS_COMPLETION=channel PYTEST_ERDMA_WORLDS=2,4 exec "$1" -c "
import sys
import torch
import pytest
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:randomly', '--durations=5', 'tests/test_collectives.py']))
"
