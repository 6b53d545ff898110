import os

import pytest

# Every test in this folder starts real processes; mark them so `-m "not dist"` skips them.
def pytest_collection_modifyitems(items):
    for item in items:
        if os.sep + "dist" + os.sep in str(item.fspath):
            item.add_marker(pytest.mark.dist)
