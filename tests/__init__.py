"""The test suite, a package so that its helpers import by name (``from tests.helpers import ...``)."""
