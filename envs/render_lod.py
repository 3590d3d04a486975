"""Opt-in coarser meshes for the camera renders only (`env.render_mesh_faces`).

A LIBERO scene hands OpenGL ~370k triangles of scanned meshes, two thirds of them in a few large ones
far from the cameras or hidden: the kitchen background behind the robot (~190k, 2-3 m from the
agent-view camera), the robot's pedestal (33k) and the arm's links (12-15k each). On an H100 / H200
only a few of the chip's units run graphics, so the renders are bound by that geometry, and they
time-slice the GPU with the policy's predict beside them (README, "Cheaper renders").

`env.render_mesh_faces=N` draws every mesh with more than N faces with at most N; smaller meshes and
every mesh of a free-moving body (the task's objects, which the wrist camera sees close up: a frying pan
has 9.3k faces) stay whole. The cut is vertex clustering: a mesh's vertices are
binned on a grid (the mesh's own frame), each bin's vertices merge into one of them (an existing vertex, so
no new positions are made), faces that collapse or repeat are dropped, and the grid is the finest that meets
the budget (bisection on its cell size). The bin keeps the vertex that lies best on the planes of the bin's
faces (the smallest error of the bin's summed quadric, Garland & Heckbert's area-weighted plane quadrics, as
in Lindstrom's out-of-core clustering), so corners and creases stay where they were; on a flat bin that is
the vertex nearest the bin's mean. Each kept face
keeps its corners' own normals and texture coordinates, so textures do not smear across seams.

Only the render context's copy of the meshes changes: MuJoCo uploads a mesh's faces when the context is
made (`mjr_makeContext`), so the faces are swapped into the model for that call and restored right
after (`coarse_meshes`; the rebuild is `envs.render_options.apply_render_options`); physics, ray casts
and every later read of the model see the original meshes. (robosuite remakes the context itself only
when a camera outgrows the offscreen buffer, 640 x 480 in LIBERO's scenes.)

Like `env.render_reflections=false` this changes the pixels a policy sees (a checkpoint trained on
LIBERO's renders saw the full meshes), so it is off by default; `experiments.probe_render_cost`
measures the time and the pixel difference per task.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.config import check_positive_int


@dataclass(frozen=True)
class ClusteredFaces:
    """The faces a mesh keeps: which of its faces (`kept`) and their new vertex indices (`faces`)."""

    kept: np.ndarray  # (k,) int, indices into the mesh's faces, ascending
    faces: np.ndarray  # (k, 3) int32, mesh-local vertex indices
    cell: float  # the grid's cell size, metres


# the 10 distinct entries (i, j), i <= j, of a symmetric 4 x 4 quadric, in the order of its (n, 10) arrays
_QUADRIC_ENTRIES = [(i, j) for i in range(4) for j in range(i, 4)]
_NORMAL_DIAGONAL = [_QUADRIC_ENTRIES.index((k, k)) for k in range(3)]  # its trace is the faces' summed area
# a bin's area times a vertex's squared distance to the bin's mean, added to its plane error: on a flat bin
# (every error ~0, up to rounding) the vertex nearest the mean wins, elsewhere the planes decide
_MEAN_PULL = 1e-6


def vertex_quadrics(vertices: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """(n, 10): each vertex's error quadric, the sum over its faces of area * p p^T with p = (unit normal,
    offset) the face's plane, so [x, 1] Q [x, 1]^T is the area-weighted squared distance of x to those
    planes. A face without area adds nothing."""
    vertices = np.asarray(vertices, dtype=np.float64)
    faces = np.asarray(faces, dtype=np.int64).reshape(-1, 3)
    a, b, c = (vertices[faces[:, corner]] for corner in range(3))
    normal = np.cross(b - a, c - a)
    twice_area = np.linalg.norm(normal, axis=1)
    unit = np.divide(normal, twice_area[:, None], out=np.zeros_like(normal), where=twice_area[:, None] > 0)
    plane = np.concatenate([unit, -np.sum(unit * a, axis=1, keepdims=True)], axis=1)
    corners = faces.ravel()
    quadrics = np.empty((len(vertices), len(_QUADRIC_ENTRIES)))
    for column, (i, j) in enumerate(_QUADRIC_ENTRIES):
        per_face = 0.5 * twice_area * plane[:, i] * plane[:, j]
        quadrics[:, column] = np.bincount(corners, weights=np.repeat(per_face, 3), minlength=len(vertices))
    return quadrics


def quadric_error(quadrics: np.ndarray, points: np.ndarray) -> np.ndarray:
    """[x, 1] Q [x, 1]^T per row: (n, 10) quadrics at (n, 3) points."""
    homogeneous = np.concatenate([points, np.ones((len(points), 1))], axis=1)
    error = np.zeros(len(points))
    for column, (i, j) in enumerate(_QUADRIC_ENTRIES):
        error += (1.0 if i == j else 2.0) * quadrics[:, column] * homogeneous[:, i] * homogeneous[:, j]
    return error


def cluster_representatives(vertices: np.ndarray, cell: float, quadrics: np.ndarray | None = None) -> np.ndarray:
    """For each vertex, the index of its bin's representative: the bin's vertex with the smallest error under
    the sum of the bin's vertex quadrics (`vertex_quadrics`), plus a pull toward the bin's mean that decides
    on flat bins; without quadrics (or on a bin whose faces have no area), the vertex nearest the mean."""
    return _bin_representatives(np.asarray(vertices, dtype=np.float64), _grid_bins(vertices, cell), quadrics)


def _bin_representatives(vertices: np.ndarray, bins: np.ndarray, quadrics: np.ndarray | None) -> np.ndarray:
    """`cluster_representatives` for vertices already binned (`_grid_bins`)."""
    count = np.bincount(bins)
    means = np.stack([np.bincount(bins, weights=vertices[:, axis]) for axis in range(3)], axis=1)
    means /= count[:, None]
    distance = np.sum((vertices - means[bins]) ** 2, axis=1)
    score = np.zeros(len(vertices))
    if quadrics is not None:
        summed = np.stack([np.bincount(bins, weights=quadrics[:, k], minlength=len(count))
                           for k in range(quadrics.shape[1])], axis=1)[bins]
        area = summed[:, _NORMAL_DIAGONAL].sum(axis=1)
        score = np.maximum(quadric_error(summed, vertices), 0.0) + _MEAN_PULL * area * distance
    # best per bin: sort by (bin, score, distance, index) and take each bin's first
    order = np.lexsort((np.arange(len(vertices)), distance, score, bins))
    first = np.ones(len(order), dtype=bool)
    first[1:] = bins[order[1:]] != bins[order[:-1]]
    representative_of_bin = np.empty(len(count), dtype=np.int64)
    representative_of_bin[bins[order[first]]] = order[first]
    return representative_of_bin[bins]


def cluster_faces(vertices: np.ndarray, faces: np.ndarray, cell: float,
                  quadrics: np.ndarray | None = None) -> ClusteredFaces:
    """The faces left after merging vertices on a grid of `cell` metres (degenerate and repeated dropped).
    `quadrics`: the mesh's `vertex_quadrics`, computed here when not given."""
    faces = np.asarray(faces, dtype=np.int64).reshape(-1, 3)
    if quadrics is None:
        quadrics = vertex_quadrics(vertices, faces)
    vertices = np.asarray(vertices, dtype=np.float64)
    bins = _grid_bins(vertices, cell)
    kept = _surviving_faces(bins[faces])
    merged = _bin_representatives(vertices, bins, quadrics)[faces[kept]]
    return ClusteredFaces(kept=kept, faces=merged.astype(np.int32), cell=cell)


def _grid_bins(vertices: np.ndarray, cell: float) -> np.ndarray:
    """Each vertex's bin on a grid of `cell` metres, as dense ids."""
    if cell <= 0:
        raise ValueError(f"cell must be positive (metres), got {cell}")
    codes = _row_codes(np.floor(np.asarray(vertices, dtype=np.float64) / cell).astype(np.int64))
    return np.unique(codes, return_inverse=True)[1]


def _surviving_faces(corner_bins: np.ndarray) -> np.ndarray:
    """Indices (ascending) of the faces whose three corners lie in three bins, the first of those with the same
    bins in the same cyclic order. Which vertex a bin keeps does not change which faces survive, so the
    budget's bisection counts these without choosing representatives."""
    distinct = ((corner_bins[:, 0] != corner_bins[:, 1]) & (corner_bins[:, 1] != corner_bins[:, 2])
                & (corner_bins[:, 0] != corner_bins[:, 2]))
    candidates = np.flatnonzero(distinct)
    # a triangle and its reversed twin are different faces (they face opposite ways): keep both,
    # but only the first of faces with the same corners in the same cyclic order
    rolled = _canonical_rotation(corner_bins[candidates])
    _, first = np.unique(_row_codes(rolled), return_index=True)
    return candidates[np.sort(first)]


def _row_codes(rows: np.ndarray) -> np.ndarray:
    """One int64 per row of a (n, 3) int array, equal exactly where the rows are equal: np.unique over these is
    what np.unique(rows, axis=0) finds, without its slow row-wise sort (the bisection runs it ~16 times a mesh)."""
    rows = rows - rows.min(axis=0, initial=0)
    span = rows.max(axis=0, initial=0) + 1
    if float(np.prod(span.astype(np.float64))) >= 2.0**63:
        raise ValueError(f"rows spanning {span.tolist()} do not fit one int64 code")
    return (rows[:, 0] * span[1] + rows[:, 1]) * span[2] + rows[:, 2]


def _canonical_rotation(triangles: np.ndarray) -> np.ndarray:
    """Each triangle's corners rotated (orientation kept) so the smallest index comes first."""
    start = np.argmin(triangles, axis=1)
    rows = np.arange(len(triangles))[:, None]
    return triangles[rows, (start[:, None] + np.arange(3)) % 3]


def free_moving_bodies(model: Any) -> np.ndarray:
    """Per body: whether it or an ancestor has a free joint (the task's objects, which the cameras see close up)."""
    import mujoco

    has_free = np.zeros(model.nbody, dtype=bool)
    has_free[model.jnt_bodyid[model.jnt_type == mujoco.mjtJoint.mjJNT_FREE]] = True
    for body in range(1, model.nbody):  # a parent's id is always below its child's
        has_free[body] |= has_free[model.body_parentid[body]]
    return has_free


def coarsened_mesh_ids(model: Any, geom_groups: np.ndarray) -> list[int]:
    """Meshes drawn by a visible geom group (the render option's `geomgroup` flags), except those of a
    free-moving body (a mesh one of them uses stays whole everywhere)."""
    import mujoco

    visible = np.flatnonzero(np.asarray(geom_groups) != 0)
    is_mesh = model.geom_type == mujoco.mjtGeom.mjGEOM_MESH
    shown = is_mesh & np.isin(model.geom_group, visible)
    moving = is_mesh & free_moving_bodies(model)[model.geom_bodyid]
    kept_whole = {int(mesh) for mesh in model.geom_dataid[moving]}
    return sorted({int(mesh) for mesh in model.geom_dataid[shown] if mesh >= 0} - kept_whole)


class _FaceArrays:
    """The model's face arrays that `mjr_makeContext` reads, saved to be restored."""

    NAMES = ("mesh_face", "mesh_facenormal", "mesh_facetexcoord", "mesh_facenum")

    def __init__(self, model: Any) -> None:
        self.model = model
        self.saved = {name: getattr(model, name).copy() for name in self.NAMES}

    def restore(self) -> None:
        for name, values in self.saved.items():
            getattr(self.model, name)[...] = values


# a process's envs share most meshes (the robot's, a scene's kitchen): each mesh is clustered once per budget
_CLUSTERED: dict[tuple[bytes, int], ClusteredFaces | None] = {}
_CLUSTERED_MAX = 512  # entries (a few KB to a few hundred KB each); the memo starts over past it


def clustered_once(vertices: np.ndarray, faces: np.ndarray, budget: int) -> ClusteredFaces | None:
    """`clustered_within_budget`, remembered in this process by the mesh's contents and the budget."""
    vertices, faces = np.ascontiguousarray(vertices), np.ascontiguousarray(faces)
    digest = hashlib.blake2b(vertices.tobytes(), digest_size=16)
    digest.update(faces.tobytes())
    key = (digest.digest(), budget)
    if key not in _CLUSTERED:
        if len(_CLUSTERED) >= _CLUSTERED_MAX:
            _CLUSTERED.clear()
        _CLUSTERED[key] = clustered_within_budget(vertices, faces, budget)
    return _CLUSTERED[key]


def clustered_within_budget(vertices: np.ndarray, faces: np.ndarray, budget: int,
                            iterations: int = 16) -> ClusteredFaces | None:
    """The faces of the finest grid that leaves at most `budget` faces (bisection on the cell size, in log
    space). None when the mesh has no more than `budget` faces (it stays whole) or when no grid that keeps
    any face meets the budget (it stays whole too: a mesh is never dropped)."""
    faces = np.asarray(faces).reshape(-1, 3)
    if len(faces) <= budget:
        return None
    vertices = np.asarray(vertices, dtype=np.float64)
    extent = float(np.max(vertices.max(axis=0) - vertices.min(axis=0)))
    fine, coarse = extent * 1e-5, extent  # fine keeps (almost) every face, coarse one bin per axis or so
    best = None
    for _ in range(iterations):
        cell = float(np.sqrt(fine * coarse))
        surviving = len(_surviving_faces(_grid_bins(vertices, cell)[faces]))
        if surviving > budget:
            fine = cell
        else:
            coarse = cell
            if surviving:
                best = cell
    return None if best is None else cluster_faces(vertices, faces, best)


def swap_in_clustered_faces(model: Any, mesh_ids: list[int], budget: int) -> tuple[_FaceArrays, dict[str, int]]:
    """Write each listed mesh's clustered faces into the model; returns the restorer and face counts."""
    saved = _FaceArrays(model)
    before = after = 0
    try:
        for mesh in mesh_ids:
            start, count = int(model.mesh_faceadr[mesh]), int(model.mesh_facenum[mesh])
            first_vertex, vertex_count = int(model.mesh_vertadr[mesh]), int(model.mesh_vertnum[mesh])
            span = slice(start, start + count)
            clustered = clustered_once(model.mesh_vert[first_vertex:first_vertex + vertex_count],
                                       saved.saved["mesh_face"][span], budget)
            kept = count if clustered is None else len(clustered.kept)
            before, after = before + count, after + kept
            if clustered is None:
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
def coarse_meshes(model: Any, geom_groups: np.ndarray, max_faces: int | None) -> Iterator[dict[str, int]]:
    """The model with each drawn mesh cut to at most `max_faces` faces inside the block (None: unchanged).

    Make the render context inside the block: the model's own faces are back when it ends, so physics
    never sees the coarse meshes. Yields the drawn meshes' face counts before and after.
    """
    if max_faces is None:
        yield {}
        return
    check_positive_int("env.render_mesh_faces", max_faces)
    saved, counts = swap_in_clustered_faces(model, coarsened_mesh_ids(model, geom_groups), max_faces)
    try:
        yield counts
    finally:
        saved.restore()
