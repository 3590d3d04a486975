"""Coarser meshes for the camera renders only (envs/render_lod.py, `env.render_mesh_faces`).

The clustering against hand-built meshes and a slow per-vertex reference; the model's own faces back
after the render context is made (a MuJoCo model from XML, no LIBERO); on a LIBERO scene: the pixels
change, the physics does not, and the full meshes come back."""

from __future__ import annotations

import numpy as np
import pytest

from envs.config import EnvConfig
from envs.render_lod import (
    _row_codes,
    cluster_faces,
    cluster_representatives,
    clustered_once,
    clustered_within_budget,
    coarse_meshes,
    coarsened_mesh_ids,
    quadric_error,
    vertex_quadrics,
)


def grid_mesh(n: int, spacing: float) -> tuple[np.ndarray, np.ndarray]:
    """An n x n grid of vertices in the z = 0 plane, two counter-clockwise triangles per square."""
    xs, ys = np.meshgrid(np.arange(n) * spacing, np.arange(n) * spacing, indexing="xy")
    vertices = np.stack([xs.ravel(), ys.ravel(), np.zeros(n * n)], axis=1)
    faces = []
    for row in range(n - 1):
        for col in range(n - 1):
            a, b, c, d = row * n + col, row * n + col + 1, (row + 1) * n + col + 1, (row + 1) * n + col
            faces += [(a, b, c), (a, c, d)]
    return vertices, np.array(faces)


def reference_bins(vertices: np.ndarray, cell: float) -> list[list[int]]:
    """The vertices of each occupied grid bin, one vertex at a time."""
    bins: dict[tuple, list[int]] = {}
    for index, vertex in enumerate(vertices):
        bins.setdefault(tuple(np.floor(vertex / cell).astype(int)), []).append(index)
    return list(bins.values())


def reference_representatives(vertices: np.ndarray, cell: float) -> np.ndarray:
    """One vertex at a time: the bin's vertex nearest the bin's mean, the lowest index on ties."""
    out = np.empty(len(vertices), dtype=np.int64)
    for members in reference_bins(vertices, cell):
        mean = vertices[members].mean(axis=0)
        best = min(members, key=lambda i: (float(np.sum((vertices[i] - mean) ** 2)), i))
        out[members] = best
    return out


def test_representatives_match_a_per_vertex_reference():
    rng = np.random.default_rng(0)
    vertices = rng.uniform(-0.05, 0.05, size=(500, 3))
    for cell in (0.004, 0.013, 0.2):
        np.testing.assert_array_equal(cluster_representatives(vertices, cell),
                                      reference_representatives(vertices, cell))


def test_representatives_by_hand():
    # bin [0, 1): vertices 0, 1, 2 with mean 0.4 -> vertex 1 (0.3) is nearest; bin [1, 2): vertex 3 alone
    vertices = np.array([[0.0, 0, 0], [0.3, 0, 0], [0.9, 0, 0], [1.5, 0, 0]])
    np.testing.assert_array_equal(cluster_representatives(vertices, 1.0), [1, 1, 1, 3])
    with pytest.raises(ValueError, match="cell must be positive"):
        cluster_representatives(vertices, 0.0)


def reference_quadrics(vertices: np.ndarray, faces: np.ndarray) -> np.ndarray:
    """(n, 4, 4), one face at a time: area * p p^T of each face's plane added to its three corners."""
    out = np.zeros((len(vertices), 4, 4))
    for face in faces:
        a, b, c = vertices[face]
        normal = np.cross(b - a, c - a)
        area = np.linalg.norm(normal) / 2
        if area == 0:
            continue
        unit = normal / np.linalg.norm(normal)
        plane = np.append(unit, -unit @ a)
        for corner in face:
            out[corner] += area * np.outer(plane, plane)
    return out


def as_matrices(quadrics: np.ndarray) -> np.ndarray:
    """(n, 10) distinct entries -> (n, 4, 4) symmetric matrices."""
    out = np.zeros((len(quadrics), 4, 4))
    column = 0
    for i in range(4):
        for j in range(i, 4):
            out[:, i, j] = out[:, j, i] = quadrics[:, column]
            column += 1
    return out


def test_vertex_quadrics_match_a_per_face_reference():
    rng = np.random.default_rng(2)
    vertices = rng.uniform(-0.1, 0.1, size=(60, 3))
    faces = rng.integers(0, 60, size=(150, 3))
    faces[0] = [3, 3, 7]  # a face without area adds nothing
    np.testing.assert_allclose(as_matrices(vertex_quadrics(vertices, faces)), reference_quadrics(vertices, faces),
                               rtol=1e-12, atol=1e-15)
    points = rng.uniform(-0.1, 0.1, size=(60, 3))
    homogeneous = np.concatenate([points, np.ones((60, 1))], axis=1)
    expected = np.einsum("ni,nij,nj->n", homogeneous, reference_quadrics(vertices, faces), homogeneous)
    np.testing.assert_allclose(quadric_error(vertex_quadrics(vertices, faces), points), expected, rtol=1e-10,
                               atol=1e-15)


def test_quadric_error_by_hand():
    # a right triangle of area 2 in the plane z = 1: a point h above that plane is off by area * h^2
    vertices = np.array([[0.0, 0, 1], [2, 0, 1], [0, 2, 1]])
    quadrics = vertex_quadrics(vertices, np.array([[0, 1, 2]]))
    np.testing.assert_allclose(quadric_error(quadrics, np.array([[5.0, -3, 1.5]] * 3)), [2 * 0.25] * 3)
    np.testing.assert_allclose(quadric_error(quadrics, vertices), [0, 0, 0], atol=1e-15)


def reference_quadric_representatives(vertices: np.ndarray, faces: np.ndarray, cell: float) -> np.ndarray:
    """One bin at a time: the bin's summed 4 x 4 quadric, each member's error plus the mean pull, the
    smallest score, then the nearest the mean, then the lowest index."""
    matrices = reference_quadrics(vertices, faces)
    out = np.empty(len(vertices), dtype=np.int64)
    for members in reference_bins(vertices, cell):
        summed = matrices[members].sum(axis=0)
        area = np.trace(summed[:3, :3])
        mean = vertices[members].mean(axis=0)

        def key(i):
            distance = float(np.sum((vertices[i] - mean) ** 2))
            h = np.append(vertices[i], 1.0)
            return (max(float(h @ summed @ h), 0.0) + 1e-6 * area * distance, distance, i)
        out[members] = min(members, key=key)
    return out


def test_quadric_representatives_match_a_per_bin_reference():
    rng = np.random.default_rng(3)
    vertices = rng.uniform(-0.05, 0.05, size=(400, 3))
    faces = rng.integers(0, 400, size=(900, 3))
    quadrics = vertex_quadrics(vertices, faces)
    for cell in (0.013, 0.03, 0.2):
        np.testing.assert_array_equal(cluster_representatives(vertices, cell, quadrics),
                                      reference_quadric_representatives(vertices, faces, cell))


def test_a_bin_keeps_the_vertex_on_its_crease():
    # a sheet folded along the y axis (planes z = x and z = -x; vertices 0 and 1 on the crease), moved to the
    # middle of one 10 m cell; the six vertices' mean lies nearest vertex 4 (on one side only); the planes keep
    # a crease vertex, and of the two the one nearer the mean (0: 0.73 m^2 against 0.90)
    vertices = np.array([[0.0, 0, 0], [0, 1, 0], [1, 0, 1], [-1, 0, 1], [1, 0.5, 1], [1, 1, 1]]) + 5.0
    faces = np.array([[0, 2, 1], [0, 1, 3], [1, 2, 4], [1, 4, 5]])
    np.testing.assert_array_equal(cluster_representatives(vertices, 10.0), [4] * 6)  # without the planes
    np.testing.assert_array_equal(cluster_representatives(vertices, 10.0, vertex_quadrics(vertices, faces)),
                                  [0] * 6)


def test_a_flat_sheet_keeps_the_vertices_nearest_the_mean():
    vertices, faces = grid_mesh(9, spacing=0.01)
    for cell in (0.025, 0.04):
        np.testing.assert_array_equal(cluster_representatives(vertices, cell, vertex_quadrics(vertices, faces)),
                                      cluster_representatives(vertices, cell))


def test_the_kept_faces_do_not_depend_on_the_representatives():
    # faces merged by the old rule (each bin's vertex nearest its mean), one face at a time: the same faces
    # survive as under the quadric rule, since a face survives by its corners' bins alone
    rng = np.random.default_rng(4)
    vertices = rng.uniform(-0.05, 0.05, size=(300, 3))
    faces = rng.integers(0, 300, size=(700, 3))
    for cell in (0.01, 0.02, 0.05):
        nearest = cluster_representatives(vertices, cell)
        kept, seen = [], set()
        for index, face in enumerate(faces.tolist()):
            merged = [int(nearest[v]) for v in face]
            rotation = tuple(np.roll(merged, -int(np.argmin(merged))).tolist())
            if len(set(merged)) == 3 and rotation not in seen:
                seen.add(rotation)
                kept.append(index)
        clustered = cluster_faces(vertices, faces, cell)
        np.testing.assert_array_equal(clustered.kept, kept)
        quadric = cluster_representatives(vertices, cell, vertex_quadrics(vertices, faces))
        np.testing.assert_array_equal(clustered.faces, quadric[faces[kept]])


def test_a_cell_below_the_spacing_keeps_every_face():
    vertices, faces = grid_mesh(6, spacing=0.01)
    # shifted half a spacing so no vertex sits on a cell boundary
    clustered = cluster_faces(vertices + 0.0025, faces, cell=0.005)
    np.testing.assert_array_equal(clustered.kept, np.arange(len(faces)))
    np.testing.assert_array_equal(clustered.faces, faces)


def test_coarse_faces_use_representatives_keep_orientation_and_drop_degenerates():
    vertices, faces = grid_mesh(9, spacing=0.01)  # a flat sheet, every normal +z
    clustered = cluster_faces(vertices, faces, cell=0.025)
    representatives = set(cluster_representatives(vertices, 0.025, vertex_quadrics(vertices, faces)).tolist())
    assert 0 < len(clustered.kept) < len(faces) / 4
    assert set(clustered.faces.ravel().tolist()) <= representatives
    assert np.all(np.diff(clustered.kept) > 0)  # kept faces stay in order
    a, b, c = (vertices[clustered.faces[:, k]] for k in range(3))
    normals = np.cross(b - a, c - a)
    assert np.all(normals[:, 2] > 0), "a kept face flipped or collapsed"
    # no face repeats with the same corners in the same cycle
    canonical = {tuple(np.roll(face, -int(np.argmin(face)))) for face in clustered.faces.tolist()}
    assert len(canonical) == len(clustered.faces)


def test_a_face_and_its_reversed_twin_are_both_kept():
    vertices = np.array([[0.0, 0, 0], [1, 0, 0], [0, 1, 0]])
    faces = np.array([[0, 1, 2], [0, 2, 1], [1, 2, 0]])  # the third repeats the first, rotated
    clustered = cluster_faces(vertices, faces, cell=0.1)
    np.testing.assert_array_equal(clustered.kept, [0, 1])


def test_the_budget_takes_the_finest_grid_that_meets_it():
    vertices, faces = grid_mesh(41, spacing=0.001)  # 3200 faces
    assert clustered_within_budget(vertices, faces, budget=3200) is None  # within the budget: whole
    for budget in (2000, 500, 50):
        clustered = clustered_within_budget(vertices, faces, budget)
        assert 0 < len(clustered.kept) <= budget
        same = cluster_faces(vertices, faces, clustered.cell)
        np.testing.assert_array_equal(same.kept, clustered.kept)
        # a grid 1% finer exceeds the budget: the bisection stopped at the edge, not anywhere below it
        assert len(cluster_faces(vertices, faces, clustered.cell * 0.99).kept) > budget


def test_row_codes_are_equal_exactly_where_the_rows_are():
    rows = np.random.default_rng(1).integers(-3, 4, size=(400, 3))
    codes = _row_codes(rows)
    same_rows = (rows[:, None, :] == rows[None, :, :]).all(axis=2)
    np.testing.assert_array_equal(codes[:, None] == codes[None, :], same_rows)
    _, first_by_code = np.unique(codes, return_index=True)
    _, first_by_row = np.unique(rows, axis=0, return_index=True)
    np.testing.assert_array_equal(np.sort(first_by_code), np.sort(first_by_row))


def test_a_mesh_is_clustered_once_per_budget():
    vertices, faces = grid_mesh(21, spacing=0.001)
    first = clustered_once(vertices, faces, 200)
    assert clustered_once(vertices.copy(), faces.copy(), 200) is first  # the same contents: remembered
    expected = clustered_within_budget(vertices, faces, 200)
    np.testing.assert_array_equal(first.kept, expected.kept)
    np.testing.assert_array_equal(first.faces, expected.faces)
    assert clustered_once(vertices, faces, 100) is not first  # another budget: clustered anew
    moved = clustered_once(vertices + [0.0005, 0, 0], faces, 200)  # other contents: clustered anew
    assert moved is not first and len(moved.kept) <= 200


MESH_XML = """
<mujoco>
  <asset>
    <mesh name="sheet" vertex="{vertices}" face="{faces}"/>
    <mesh name="hidden" vertex="0 0 0  0.1 0 0  0 0.1 0  0 0 0.1"/>
    <mesh name="object" vertex="0 0 0  0.1 0 0  0 0.1 0  0 0 0.1"/>
  </asset>
  <worldbody>
    <geom name="sheet" type="mesh" mesh="sheet" group="1" contype="0" conaffinity="0"/>
    <geom name="hidden" type="mesh" mesh="hidden" group="0" pos="1 0 0"/>
    <body name="thing" pos="0 1 0">
      <freejoint/>
      <body name="part"><geom name="object" type="mesh" mesh="object" group="1"/></body>
    </body>
  </worldbody>
</mujoco>
"""


def sheet_model():
    mujoco = pytest.importorskip("mujoco")
    vertices, faces = grid_mesh(9, spacing=0.01)
    # a second layer 1 cm below keeps the mesh three-dimensional for MuJoCo's compiler
    vertices = np.concatenate([vertices, vertices - [0, 0, 0.01]])
    faces = np.concatenate([faces, faces[:, ::-1] + 81])
    xml = MESH_XML.format(vertices=" ".join(map(str, vertices.ravel())), faces=" ".join(map(str, faces.ravel())))
    return mujoco.MjModel.from_xml_string(xml)


def test_visible_meshes_of_fixed_bodies_are_coarsened():
    """The visible groups' meshes, but none of a free-moving body (here on a child of the free body)."""
    model = sheet_model()
    assert coarsened_mesh_ids(model, np.array([0, 1, 1, 0, 0, 0])) == [0]
    assert coarsened_mesh_ids(model, np.array([1, 1, 0, 0, 0, 0])) == [0, 1]


def test_the_models_faces_are_back_after_the_block():
    model = sheet_model()
    names = ("mesh_face", "mesh_facenormal", "mesh_facetexcoord", "mesh_facenum")
    before = {name: getattr(model, name).copy() for name in names}
    groups = np.array([0, 1, 1, 0, 0, 0])
    with coarse_meshes(model, groups, 40) as counts:
        assert 0 < counts["faces_after"] <= 40 < counts["faces_before"] == before["mesh_facenum"][0]
        assert model.mesh_facenum[0] == counts["faces_after"]
        assert model.mesh_facenum[1] == before["mesh_facenum"][1]  # group 0: not drawn, untouched
    for name in names:
        np.testing.assert_array_equal(getattr(model, name), before[name], err_msg=name)
    with pytest.raises(RuntimeError, match="inside"):  # restored on an exception too
        with coarse_meshes(model, groups, 40):
            raise RuntimeError("inside")
    np.testing.assert_array_equal(model.mesh_facenum, before["mesh_facenum"])
    with coarse_meshes(model, groups, None) as counts:  # None: the full meshes
        assert counts == {}
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="env.render_mesh_faces"):
            with coarse_meshes(model, groups, bad):
                pass


def test_the_mesh_cell_is_checked_by_name():
    for bad in (0, "4000", 2.5):
        with pytest.raises(ValueError, match="env.render_mesh_faces"):
            EnvConfig(render_mesh_faces=bad)
    with pytest.raises(ValueError, match="apply to env_type 'libero' only"):
        EnvConfig(env_type="reach", render_mesh_faces=4000)
    assert EnvConfig(render_mesh_faces=4000).render_mesh_faces == 4000


def check_coarse_meshes_change_pixels_not_physics(backend: str, image_size: int) -> None:
    """Shared by the OSMesa test here and the EGL one (tests/envs/test_gpu_render.py)."""
    from envs.libero_env import LiberoEnv
    from envs.render_options import apply_render_options
    from envs.suites import get_task

    def images(env):
        return {k: v for k, v in env.observation(render=True).items() if k.endswith("_image")}

    task = get_task("libero_10", 2)
    full = LiberoEnv(task, image_size=image_size, step_mode="lean", render_backend=backend)
    coarse = LiberoEnv(task, image_size=image_size, step_mode="lean", render_backend=backend, render_mesh_faces=4000)
    try:
        for env in (full, coarse):
            env.begin_episode(0, seed=0)
        assert 0 < coarse.render_faces["faces_after"] < coarse.render_faces["faces_before"] / 2
        model = coarse.libero_env.sim.model._model
        assert model.mesh_facenum.max() > 4000  # the model keeps its full meshes
        assert full.render_faces == {}
        default, cheap = images(full), images(coarse)
        assert any(not np.array_equal(default[key], cheap[key]) for key in default)
        for key in default:  # the same scene, drawn coarser
            assert np.abs(default[key].astype(int) - cheap[key]).mean() < 8, key
        rng = np.random.default_rng(0)
        for _ in range(5):
            action = rng.uniform(-0.5, 0.5, 7)
            assert full.control_step(action) == coarse.control_step(action)
        for env in (full, coarse):
            env.observation(render=True)  # a render between the steps leaves the physics alone
        np.testing.assert_array_equal(full.libero_env.sim.data.qpos, coarse.libero_env.sim.data.qpos)
        apply_render_options(coarse.libero_env, mesh_faces=None)  # back to the full meshes
        back, again = images(coarse), images(full)
        for key in again:
            np.testing.assert_array_equal(back[key], again[key], err_msg=key)
    finally:
        full.close()
        coarse.close()


@pytest.mark.libero
def test_coarse_meshes_change_the_pixels_not_the_physics_and_come_back():
    check_coarse_meshes_change_pixels_not_physics("auto", image_size=96)
