"""Marks the wheel as platform-specific: it carries a native library (flashcomm/lib/libnccl.so.2)
but no Python extension, so setuptools would otherwise build a pure `py3-none-any` wheel. The tag
(`py3-none-<platform>`) comes from wheel-platform.txt, which ci/build-wheel.sh writes from the
library's glibc symbol versions."""
import os

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))


class PlatformWheel(bdist_wheel):
    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        with open(os.path.join(HERE, "wheel-platform.txt")) as f:
            platform = f.read().strip()
        return "py3", "none", platform


setup(cmdclass={"bdist_wheel": PlatformWheel})
