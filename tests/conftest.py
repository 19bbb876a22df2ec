"""make test's two halves (Makefile): two pytest processes side by side on a 2-core machine.

The learner half is tests/test_ppo_clash.py's slow tests, marked `learner_half` here, each half
then one -m expression. A slow test of that file marked `other_half` runs in the other half,
after the fast tests, to bring the halves' lengths close (within about a minute and a half on a
2-core machine, docs/status.md's issue 49 row): a test that shares a module fixture moves with
every test that reads it (the fixture is built once in each process that runs one of them)."""
import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if (item.path.name == "test_ppo_clash.py" and item.get_closest_marker("slow")
                and not item.get_closest_marker("other_half")):
            item.add_marker("learner_half")
