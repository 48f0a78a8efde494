"""Every on/off switch (UNIFIED_DIST_DEBUG, UNIFIED_DIST_SYNC_BATCHNORM, ACCELERATE_USE_FSDP, ...)
reads the same spellings."""
import pytest

from unified_dist.flags import is_set


@pytest.mark.parametrize("text", ["1", "true", "TRUE", " yes ", "On"])
def test_truthy_spellings_turn_a_switch_on(text):
    assert is_set(text) is True
    assert is_set(text, default=False) is True


@pytest.mark.parametrize("text", ["0", "false", "no", "off", "", "2", "enabled"])
def test_anything_else_turns_it_off_even_where_the_default_is_on(text):
    assert is_set(text, default=True) is False


def test_unset_gives_the_default():
    assert is_set(None) is False
    assert is_set(None, default=True) is True
