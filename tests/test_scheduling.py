"""The suite's scheduling holds: a test of a group runs on its group's worker. conftest.py tells
xdist a test's group through pytest's node id (`_group_in_node_id`, which writes a private field
of pytest 9.2): if a pytest release changes that, every worker would silently build every
session bundle again and the suite would take minutes longer. This test makes that loud."""
from __future__ import annotations

import pytest


@pytest.mark.xdist_group("ray")  # an existing group: this test adds no worker of its own
def test_a_grouped_test_tells_xdist_its_group(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not an xdist worker under --dist loadgroup (-n 0): nothing is scheduled")
    assert request.node.nodeid.endswith("@ray"), request.node.nodeid
