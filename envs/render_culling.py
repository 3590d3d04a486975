"""Frustum culling for robosuite's offscreen camera renders: the same pixels, fewer triangles.

MuJoCo hands every visible geom of the scene to OpenGL, which transforms all of a mesh's vertices
before clipping what lies outside the view. LIBERO's scenes carry ~380k triangles of scanned meshes
(kitchen furniture, walls, objects), and a camera sees a part of them: the wrist camera often under
half. Geoms whose bounding sphere lies entirely outside the camera's view frustum cannot put a
fragment on screen (no LIBERO light casts a shadow, and a geom does not light another), so leaving
them out of the scene changes no pixel and skips their vertex work: that is this module.

Where it pays (measured, README "Cheaper renders"): under OSMesa, whose CPU rasteriser does the vertex
work, a render of both cameras gets 10-20% faster. Under EGL on the H100 it saved no GPU time (a whole
rollout 1286 against 1297 env steps/s unculled) and its Python (~0.3 ms a camera) made a lone render
slower, so `env.render_culling: null` (the default) turns it on under OSMesa only.

Reflections are the one way a geom outside the frustum shows: MuJoCo draws the scene a second
time, mirrored across each reflective plane or box, through a stencil of that geom. So with
reflections on, a geom is also kept when its mirror image can be seen through a reflective geom:
its reflected bounding sphere (widened by twice the box's half-height, whichever face mirrors)
meets the cone from the eye around that geom's bounding sphere.

Reflective planes and boxes themselves are never culled: mjr_render mirrors only the first of them in
the scene's order (it zeroes the others' reflectance), so dropping one could hand the mirror to
another. Nothing is culled when a light casts shadows (a geom outside the view can shade one in
it; no LIBERO light does) or for an orthographic camera (the frustum here is a perspective one).

The test is conservative (bounding spheres, a margin), and the kept geoms keep their order (the
culled ones are hidden for the scene update by a geom group the render options leave off), so depth
ties and the order of transparent geoms are MuJoCo's own. Tests compare the pixels with and without
culling on LIBERO scenes of every suite (OSMesa in CI, EGL on the GPU box).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

MARGIN_SCALE = 1.01  # bounding spheres widened by 1% + 1 mm: float error never culls a visible geom
MARGIN_M = 1e-3


def frustum_half_spaces(glcam: Any, aspect: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The view frustum of an OpenGL camera as six inward half-spaces `normal . (p - eye) + offset >= 0`.

    Follows mjr_render's projection: a frustum_width of 0 means the half-width that matches the
    viewport's aspect ratio."""
    eye = np.asarray(glcam.pos, dtype=np.float64)
    forward = np.asarray(glcam.forward, dtype=np.float64)
    up = np.asarray(glcam.up, dtype=np.float64)
    right = np.cross(forward, up)
    near, far = float(glcam.frustum_near), float(glcam.frustum_far)
    half_width = float(glcam.frustum_width) or 0.5 * aspect * (glcam.frustum_top - glcam.frustum_bottom)
    left, right_edge = glcam.frustum_center - half_width, glcam.frustum_center + half_width
    bottom, top = float(glcam.frustum_bottom), float(glcam.frustum_top)
    # a side plane contains the eye and the frustum's edge at the near plane (e.g. near*forward +
    # right_edge*right); its inward normal is perpendicular to that edge within (forward, side axis)
    normals = np.stack([
        right_edge * forward - near * right,
        -left * forward + near * right,
        top * forward - near * up,
        -bottom * forward + near * up,
        forward,
        -forward,
    ])
    normals /= np.linalg.norm(normals, axis=1, keepdims=True)
    offsets = np.array([0.0, 0.0, 0.0, 0.0, -near, far])
    return eye, normals, offsets


def spheres_in_frustum(centers: np.ndarray, radii: np.ndarray, frustum: tuple) -> np.ndarray:
    """True where a sphere is not entirely outside one of the frustum's half-spaces."""
    eye, normals, offsets = frustum
    distances = (centers - eye) @ normals.T + offsets  # (n, 6)
    return np.all(distances >= -radii[:, None], axis=1)


def spheres_seen_through(centers: np.ndarray, radii: np.ndarray, eye: np.ndarray, mirror_center: np.ndarray,
                         mirror_radius: float) -> np.ndarray:
    """True where a sphere meets the cone of sight lines from the eye through the mirror's bounding sphere."""
    axis = mirror_center - eye
    axis_length = np.linalg.norm(axis)
    if axis_length <= mirror_radius:
        return np.ones(len(centers), dtype=bool)  # the eye is inside the mirror's bounding sphere
    cone = np.arcsin(mirror_radius / axis_length)
    offsets = centers - eye
    lengths = np.linalg.norm(offsets, axis=1)
    inside = lengths <= radii
    cosines = (offsets @ axis) / np.maximum(lengths * axis_length, 1e-12)
    angles = np.arccos(np.clip(cosines, -1.0, 1.0))
    spread = np.arcsin(np.clip(radii / np.maximum(lengths, 1e-12), 0.0, 1.0))
    return inside | (angles - spread <= cone)


def mirror_geoms(model: Any, vopt: Any) -> np.ndarray:
    """Geoms MuJoCo may mirror the scene across: reflective planes and boxes in a shown group."""
    import mujoco

    types = model.geom_type
    material = model.geom_matid
    reflective = (material >= 0) & (model.mat_reflectance[np.maximum(material, 0)] > 0)
    shown = np.asarray(vopt.geomgroup, dtype=bool)[np.clip(model.geom_group, 0, len(vopt.geomgroup) - 1)]
    planar = (types == mujoco.mjtGeom.mjGEOM_PLANE) | (types == mujoco.mjtGeom.mjGEOM_BOX)
    return np.flatnonzero(reflective & shown & planar)


def visible_geoms(model: Any, data: Any, glcam: Any, aspect: float, reflections: bool,
                  mirrors: np.ndarray) -> np.ndarray:
    """Per model geom: may it put a fragment on screen from this camera (directly or in a mirror)?"""
    import mujoco

    centers = np.asarray(data.geom_xpos, dtype=np.float64)
    radii = np.asarray(model.geom_rbound, dtype=np.float64) * MARGIN_SCALE + MARGIN_M
    unbounded = model.geom_rbound <= 0  # planes (infinite) and anything MuJoCo gives no bound
    frustum = frustum_half_spaces(glcam, aspect)
    keep = unbounded | spheres_in_frustum(centers, radii, frustum)
    keep[mirrors] = True  # which one mjr_render mirrors depends on all of them being there
    if not reflections:
        return keep
    eye = frustum[0]
    for mirror in mirrors:
        normal = np.asarray(data.geom_xmat[mirror], dtype=np.float64).reshape(3, 3)[:, 2]
        point = np.asarray(data.geom_xpos[mirror], dtype=np.float64)
        is_box = model.geom_type[mirror] == mujoco.mjtGeom.mjGEOM_BOX
        widen = 2.0 * model.geom_size[mirror, 2] if is_box else 0.0
        reflected = centers - 2.0 * ((centers - point) @ normal)[:, None] * normal
        if model.geom_rbound[mirror] <= 0:  # an infinite plane: its mirror image anywhere in view
            keep |= spheres_in_frustum(reflected, radii + widen, frustum)
        else:
            keep |= spheres_seen_through(reflected, radii + widen, eye, point,
                                         model.geom_rbound[mirror] * MARGIN_SCALE + MARGIN_M)
    return keep


def casts_shadows(model: Any, scene: Any) -> bool:
    """Whether a light of the model may cast a shadow in this scene."""
    import mujoco

    return bool(scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW]) and bool(np.any(model.light_castshadow))


def hidden_group(vopt: Any) -> int | None:
    """A geom group the render leaves off (robosuite shows groups 0-2), or None."""
    off = np.flatnonzero(~np.asarray(vopt.geomgroup, dtype=bool))
    return int(off[0]) if len(off) else None


def camera_scene(context: Any) -> Any:
    """A scratch scene of the context's model, for computing the camera alone. The render's own scene must
    not see the new camera before mjv_updateScene: MuJoCo lays out an infinite plane's grid from the
    scene's camera as it was when geoms are added (the previous render's)."""
    import mujoco

    scratch = context.__dict__.get("_culling_camera_scene")
    if scratch is None:
        scratch = mujoco.MjvScene(context.model._model, maxgeom=1)
        context.__dict__["_culling_camera_scene"] = scratch
    return scratch


def geoms_to_hide(context: Any, aspect: float) -> np.ndarray | None:
    """Mask of the model geoms this render may leave out, or None (none, or culling is not safe here)."""
    import mujoco

    model, data = context.model._model, context.data._data
    if casts_shadows(model, context.scn):
        return None
    scratch = camera_scene(context)
    mujoco.mjv_updateCamera(model, data, context.cam, scratch)
    glcam = mujoco.mjv_averageCamera(scratch.camera[0], scratch.camera[1])  # mjr_render's mono eye
    if glcam.orthographic:
        return None
    reflections = bool(context.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION])
    keep = visible_geoms(model, data, glcam, aspect, reflections, mirror_geoms(model, context.vopt))
    return None if keep.all() else ~keep


def culled_render(context: Any, width: int, height: int, camera_id: int | None = None,
                  segmentation: bool = False) -> None:
    """robosuite's `MjRenderContext.render` (robosuite 1.4.0) with the geoms outside the view left out."""
    import mujoco

    model, data = context.model._model, context.data._data
    viewport = mujoco.MjrRect(0, 0, width, height)
    if width > context.con.offWidth or height > context.con.offHeight:
        context.update_offscreen_size(max(width, model.vis.global_.offwidth),
                                      max(height, model.vis.global_.offheight))
    if camera_id is not None:
        context.cam.type = mujoco.mjtCamera.mjCAMERA_FREE if camera_id == -1 else mujoco.mjtCamera.mjCAMERA_FIXED
        context.cam.fixedcamid = camera_id
    group = None if segmentation else hidden_group(context.vopt)
    hide = None if group is None else geoms_to_hide(context, width / height)
    groups = None
    if hide is not None:
        groups = model.geom_group.copy()
        model.geom_group[hide] = group
    try:
        mujoco.mjv_updateScene(model, data, context.vopt, context.pert, context.cam, mujoco.mjtCatBit.mjCAT_ALL,
                               context.scn)
    finally:
        if groups is not None:
            model.geom_group[:] = groups  # the model as it was: only this scene update saw the hiding
    if segmentation:
        context.scn.flags[mujoco.mjtRndFlag.mjRND_SEGMENT] = 1
        context.scn.flags[mujoco.mjtRndFlag.mjRND_IDCOLOR] = 1
    mujoco.mjr_render(viewport=viewport, scn=context.scn, con=context.con)
    if segmentation:
        context.scn.flags[mujoco.mjtRndFlag.mjRND_SEGMENT] = 0
        context.scn.flags[mujoco.mjtRndFlag.mjRND_IDCOLOR] = 0


def culling_enabled(setting: bool | None, backend: str) -> bool:
    """`env.render_culling` as applied under GL `backend`: null culls under OSMesa only (module docstring)."""
    return backend == "osmesa" if setting is None else setting


def set_frustum_culling(robosuite_env: Any, enabled: bool = True) -> None:
    """Route the env's offscreen renders through `culled_render` (this env's context only), or back to
    robosuite's own `render`."""
    from envs.render_options import render_context

    context = render_context(robosuite_env)
    if enabled:
        context.render = functools.partial(culled_render, context)
    else:
        context.__dict__.pop("render", None)  # the class's method again
