"""The README's Python example runs as written."""
import os
import re

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", open(README).read(), re.S)
    assert blocks, "README.md has no python example"
    for code in blocks:
        namespace = {}
        exec(compile(code, README, "exec"), namespace)
        if "store" in namespace:
            assert namespace["store"].num_tokens > 0
