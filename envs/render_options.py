"""Opt-in cheaper camera renders for LIBERO scenes (`env.render_reflections`, `env.render_multisamples`,
`env.render_mesh_faces`).

LIBERO's scenes give some boxes and planes a reflective material (a stove's base, a table top, in
some styles the floor). MuJoCo draws every such geom's reflection by rendering the whole scene a
second time, mirrored, through a stencil of the geom: two reflective boxes in view make three passes
over ~380k triangles of scanned meshes. Turning reflections off skips those passes; the pixels
change only where a reflection was visible (often almost nowhere: `experiments.probe_render_cost`
measures both the time and the pixel difference per task). Multisampling (MuJoCo's offscreen 4x
MSAA by default) smooths edges; 0 turns it off. Coarser meshes (envs/render_lod.py) draw fewer of
those triangles.

All three change the images a policy sees, so all three are off by default: a checkpoint trained on
LIBERO's demonstrations saw reflections, 4x multisampling and the full meshes. Shadows cost nothing
here (no LIBERO light casts one), so they have no option.

Applied to robosuite's offscreen render context once the env exists; robosuite keeps that context
for the env's life with hard_reset=False (the harness's setting), so the options hold across resets.
"""

from __future__ import annotations

from typing import Any

DEFAULT_REFLECTIONS = True
DEFAULT_MULTISAMPLES = None  # None: the scene's own (MuJoCo's default 4)
DEFAULT_MESH_FACES = None  # None: the full meshes (envs/render_lod.py)
# the face budget a robosuite render context was made with (absent: the full meshes)
MESH_FACES_ATTRIBUTE = "_vla_rollout_mesh_faces"


def render_context(robosuite_env: Any) -> Any:
    """robosuite's offscreen render context of the env (created with the env when it has cameras)."""
    context = robosuite_env.sim._render_context_offscreen
    if context is None:
        raise RuntimeError("the env has no offscreen render context (built without cameras?): "
                           "render options need one")
    return context


def apply_render_options(robosuite_env: Any, reflections: bool = DEFAULT_REFLECTIONS,
                         multisamples: int | None = DEFAULT_MULTISAMPLES,
                         mesh_faces: int | None = DEFAULT_MESH_FACES) -> dict[str, int]:
    """Set the reflection pass, the offscreen multisample count and the drawn meshes' detail.

    `multisamples` (not None, and unlike the context's) rebuilds MuJoCo's render context (offscreen
    buffers are allocated with their sample count); None leaves the count as it is. `mesh_faces`
    (envs/render_lod.py) rebuilds it with each drawn mesh cut to at most that many faces, None with the
    full meshes, each only when the context holds another. The reflection flag is set either way, so a
    later call can turn reflections back on. Returns the drawn meshes' face counts when the context was
    made with coarse meshes, else {}.
    """
    import mujoco

    from envs.render_lod import coarse_meshes

    context = render_context(robosuite_env)
    context.gl_ctx.make_current()  # several envs in one process each own a GL context
    # mjv_updateScene leaves scene flags alone, so the flag holds for every later render
    context.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = int(bool(reflections))
    new_samples = multisamples is not None and multisamples != context.con.offSamples
    new_meshes = mesh_faces != getattr(context, MESH_FACES_ATTRIBUTE, None)
    if not (new_samples or new_meshes):
        return {}
    if multisamples is not None:
        context.model.vis.quality.offsamples = int(multisamples)
    with coarse_meshes(context.model._model, context.vopt.geomgroup, mesh_faces) as faces:
        context.con.free()
        context._set_mujoco_context_and_buffers()  # robosuite's own rebuild (as on an offscreen resize)
    setattr(context, MESH_FACES_ATTRIBUTE, mesh_faces)
    if multisamples is not None and context.con.offSamples != multisamples:
        raise RuntimeError(f"env.render_multisamples={multisamples}: the GL driver gave "
                           f"{context.con.offSamples} samples")
    return faces
