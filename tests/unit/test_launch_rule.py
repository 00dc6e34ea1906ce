"""The rule of tests/conftest.py: a test that starts processes carries ``@pytest.mark.launch(ranks=N, full=...)``,
and the harness's launch functions refuse one that does not, or that starts more than it declares."""

import pytest

from tests.conftest import LaunchRuleError, _check, _launch_marker
from tests.harness import launching


class _Test:
    """What the rule reads of a collected test: its id and its closest ``launch`` marker."""

    def __init__(self, marker: pytest.MarkDecorator | None = None):
        self.nodeid = "tests/test_x.py::test_x"
        self.marker = marker.mark if marker else None

    def get_closest_marker(self, name: str):
        return self.marker if name == "launch" else None


def test_a_launch_from_a_test_without_the_marker_fails():
    # this very test carries no marker: the guard the harness calls before starting ranks refuses it
    with pytest.raises(LaunchRuleError, match=r"launches 2 rank\(s\) without a launch marker: decorate it with "
                                              r"@pytest.mark.launch\(ranks=2\)"):
        launching(2)


def test_more_ranks_than_declared_fail():
    with pytest.raises(LaunchRuleError, match=r"launches 4 ranks but is marked launch\(ranks=2\)"):
        _check(_Test(pytest.mark.launch(ranks=2)), 4, "launches")
    _check(_Test(pytest.mark.launch(ranks=4)), 2, "launches")  # fewer is fine: N is the most it starts


def test_a_run_of_the_full_set_needs_full():
    with pytest.raises(LaunchRuleError, match=r"uses the run 'tp4' of a launch of the full run: mark it "
                                              r"launch\(\.\.\., full=True\)"):
        _check(_Test(pytest.mark.launch(ranks=4)), 4, "uses the run 'tp4' of", full=True)
    _check(_Test(pytest.mark.launch(ranks=4, full=True)), 4, "uses the run 'tp4' of", full=True)


@pytest.mark.parametrize("marker", [pytest.mark.launch(2), pytest.mark.launch(ranks=0),
                                    pytest.mark.launch(ranks=2, full="yes"), pytest.mark.launch(ranks=2, nodes=2)])
def test_a_marker_of_another_form_is_refused(marker):
    with pytest.raises(pytest.UsageError, match=r"write the marker as launch\(ranks=N, full=False\)"):
        _launch_marker(_Test(marker))
