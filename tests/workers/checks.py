"""Assertion helpers shared by the multi-rank test workers."""


def expect(exc_type, fn, *needles) -> str:
    """Call ``fn`` and require ``exc_type`` whose message contains every needle."""
    try:
        fn()
    except exc_type as exc:
        text = str(exc)
        missing = [n for n in needles if n not in text]
        assert not missing, f"message {text!r} lacks {missing}"
        return text
    raise AssertionError(f"expected {exc_type.__name__}")
