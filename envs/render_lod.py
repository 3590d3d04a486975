"""Opt-in coarser meshes for the camera renders only (`env.render_mesh_cell_mm`).

A LIBERO scene hands OpenGL ~370k triangles of scanned meshes (the kitchen background, the stove, the
robot's links), most of them far below a pixel at 224 px: the agent-view camera sees ~3.6 mm per pixel
across the table. On an H100 / H200 only a few of the chip's units run graphics, so the renders are
bound by that geometry, and they time-slice the GPU with the policy's predict beside them (README,
"Cheaper renders").

Vertex clustering: a mesh's vertices are binned on a grid of `cell` metres (the mesh's own frame,
scale applied), each bin's vertices merge into the bin's vertex closest to the bin's mean (an existing
vertex, so no new positions are made), and faces that collapse or repeat are dropped. Each kept face
keeps its corners' own normals and texture coordinates. Only the render context's copy of the meshes
changes: MuJoCo uploads a mesh's faces when the context is made (`mjr_makeContext`), so the faces are
swapped into the model for that call and restored right after (`coarse_meshes`; the rebuild is
`envs.render_options.apply_render_options`); physics, ray casts and every later read of the model see
the original meshes. (robosuite remakes the context itself only when a camera outgrows the offscreen
buffer, 640 x 480 in LIBERO's scenes.)

Like `env.render_reflections=false` this changes the pixels a policy sees (a checkpoint trained on
LIBERO's renders saw the full meshes), so it is off by default; `experiments.probe_render_cost`
measures the time and the pixel difference per task.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ClusteredFaces:
    """The faces a mesh keeps: which of its faces (`kept`) and their new vertex indices (`faces`)."""

    kept: np.ndarray  # (k,) int, indices into the mesh's faces, ascending
    faces: np.ndarray  # (k, 3) int32, mesh-local vertex indices


def cluster_representatives(vertices: np.ndarray, cell: float) -> np.ndarray:
    """For each vertex, the index of its bin's representative (the bin's vertex nearest the bin's mean)."""
    if cell <= 0:
        raise ValueError(f"cell must be positive (metres), got {cell}")
    vertices = np.asarray(vertices, dtype=np.float64)
    keys = np.floor(vertices / cell).astype(np.int64)
    _, bins = np.unique(keys, axis=0, return_inverse=True)
    bins = bins.reshape(-1)
    count = np.bincount(bins)
    means = np.stack([np.bincount(bins, weights=vertices[:, axis]) for axis in range(3)], axis=1)
    means /= count[:, None]
    distance = np.sum((vertices - means[bins]) ** 2, axis=1)
    # nearest per bin: sort by (bin, distance, index) and take each bin's first
    order = np.lexsort((np.arange(len(vertices)), distance, bins))
    first = np.ones(len(order), dtype=bool)
    first[1:] = bins[order[1:]] != bins[order[:-1]]
    representative_of_bin = np.empty(len(count), dtype=np.int64)
    representative_of_bin[bins[order[first]]] = order[first]
    return representative_of_bin[bins]


def cluster_faces(vertices: np.ndarray, faces: np.ndarray, cell: float) -> ClusteredFaces:
    """The faces left after merging vertices on a grid of `cell` metres (degenerate and repeated dropped)."""
    faces = np.asarray(faces, dtype=np.int64).reshape(-1, 3)
    merged = cluster_representatives(vertices, cell)[faces]
    distinct = ((merged[:, 0] != merged[:, 1]) & (merged[:, 1] != merged[:, 2])
                & (merged[:, 0] != merged[:, 2]))
    candidates = np.flatnonzero(distinct)
    # a triangle and its reversed twin are different faces (they face opposite ways): keep both,
    # but only the first of faces with the same corners in the same cyclic order
    rolled = _canonical_rotation(merged[candidates])
    _, first = np.unique(rolled, axis=0, return_index=True)
    kept = candidates[np.sort(first)]
    return ClusteredFaces(kept=kept, faces=merged[kept].astype(np.int32))


def _canonical_rotation(triangles: np.ndarray) -> np.ndarray:
    """Each triangle's corners rotated (orientation kept) so the smallest index comes first."""
    start = np.argmin(triangles, axis=1)
    rows = np.arange(len(triangles))[:, None]
    return triangles[rows, (start[:, None] + np.arange(3)) % 3]


def rendered_mesh_ids(model: Any, geom_groups: np.ndarray) -> list[int]:
    """Meshes drawn by a visible geom group (the render option's `geomgroup` flags)."""
    import mujoco

    visible = np.flatnonzero(np.asarray(geom_groups) != 0)
    is_mesh = model.geom_type == mujoco.mjtGeom.mjGEOM_MESH
    shown = is_mesh & np.isin(model.geom_group, visible)
    return sorted({int(mesh) for mesh in model.geom_dataid[shown] if mesh >= 0})


class _FaceArrays:
    """The model's face arrays that `mjr_makeContext` reads, saved to be restored."""

    NAMES = ("mesh_face", "mesh_facenormal", "mesh_facetexcoord", "mesh_facenum")

    def __init__(self, model: Any) -> None:
        self.model = model
        self.saved = {name: getattr(model, name).copy() for name in self.NAMES}

    def restore(self) -> None:
        for name, values in self.saved.items():
            getattr(self.model, name)[...] = values


def swap_in_clustered_faces(model: Any, mesh_ids: list[int], cell: float) -> tuple[_FaceArrays, dict[str, int]]:
    """Write each listed mesh's clustered faces into the model; returns the restorer and face counts."""
    saved = _FaceArrays(model)
    before = after = 0
    try:
        for mesh in mesh_ids:
            start, count = int(model.mesh_faceadr[mesh]), int(model.mesh_facenum[mesh])
            first_vertex, vertex_count = int(model.mesh_vertadr[mesh]), int(model.mesh_vertnum[mesh])
            span = slice(start, start + count)
            clustered = cluster_faces(model.mesh_vert[first_vertex:first_vertex + vertex_count],
                                      saved.saved["mesh_face"][span], cell)
            kept = len(clustered.kept) or count  # a mesh inside one cell: drawn whole rather than not at all
            before, after = before + count, after + kept
            if kept == count:
                continue
            new = slice(start, start + kept)
            model.mesh_face[new] = clustered.faces
            for name in ("mesh_facenormal", "mesh_facetexcoord"):
                getattr(model, name)[new] = saved.saved[name][span][clustered.kept]
            model.mesh_facenum[mesh] = kept
    except BaseException:
        saved.restore()
        raise
    return saved, {"faces_before": before, "faces_after": after}


@contextmanager
def coarse_meshes(model: Any, geom_groups: np.ndarray, cell_mm: float | None) -> Iterator[dict[str, int]]:
    """The model with its drawn meshes clustered on a `cell_mm` grid inside the block (None: unchanged).

    Make the render context inside the block: the model's own faces are back when it ends, so physics
    never sees the coarse meshes. Yields the drawn meshes' face counts before and after.
    """
    if cell_mm is None:
        yield {}
        return
    if isinstance(cell_mm, bool) or not isinstance(cell_mm, (int, float)) or not cell_mm > 0:
        raise ValueError(f"env.render_mesh_cell_mm must be a positive number (millimetres) or null, got {cell_mm!r}")
    saved, counts = swap_in_clustered_faces(model, rendered_mesh_ids(model, geom_groups), cell_mm / 1000.0)
    try:
        yield counts
    finally:
        saved.restore()
