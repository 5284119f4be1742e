"""Training graphs: types, JSON files, capture from torch models."""

from xengine.graph.types import CopyModel, Edge, Graph, GraphError, Node

__all__ = ["CopyModel", "Edge", "Graph", "GraphError", "Node"]
