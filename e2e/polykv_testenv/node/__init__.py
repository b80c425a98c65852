"""The process node: pods bound to it run as local processes (see node.py)."""

from .images import ImageCommand, ImageTable
from .node import ProcessNode

__all__ = ["ImageCommand", "ImageTable", "ProcessNode"]
