"""Frustum culling of LIBERO renders (envs/render_culling.py): the geometry against hand-placed spheres and a
point-sampling reference (a sphere with any point in view is never culled), and on real scenes of every
suite the culled render's pixels equal robosuite's own render, reflections on and off."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from envs.render_culling import frustum_half_spaces, spheres_in_frustum, spheres_seen_through


def camera(pos=(0.0, 0.0, 0.0), forward=(1.0, 0.0, 0.0), up=(0.0, 0.0, 1.0), near=0.1, far=10.0, top=0.05,
           center=0.0, width=0.0):
    return SimpleNamespace(pos=np.array(pos), forward=np.array(forward), up=np.array(up), frustum_near=near,
                           frustum_far=far, frustum_top=top, frustum_bottom=-top, frustum_center=center,
                           frustum_width=width, orthographic=0)


def test_frustum_against_hand_placed_spheres():
    frustum = frustum_half_spaces(camera(), aspect=1.0)
    slope = 0.05 / 0.1  # half-width over depth: 5 m ahead the view reaches 2.5 m either side of the axis
    centers = np.array([
        [5.0, 0.0, 0.0],             # on the axis
        [-1.0, 0.0, 0.0],            # behind the eye
        [12.0, 0.0, 0.0],            # beyond the far plane
        [5.0, 5 * slope + 0.3, 0.0],   # right of the view by 0.3 m (the side plane's distance is less)
        [5.0, 5 * slope + 0.05, 0.0],  # just past the edge, radius reaches back in
        [5.0, 0.0, -(5 * slope + 0.3)],  # below the view
        [0.05, 0.0, 0.0],            # in front of the near plane, but the sphere reaches past it
    ])
    radii = np.array([0.1, 0.5, 1.0, 0.2, 0.2, 0.2, 0.1])
    expected = [True, False, False, False, True, False, True]
    assert spheres_in_frustum(centers, radii, frustum).tolist() == expected


def point_in_frustum(points: np.ndarray, cam, aspect: float) -> np.ndarray:
    """The slow reference: project each point into the camera's frame and compare with the frustum."""
    forward, up = cam.forward / np.linalg.norm(cam.forward), cam.up / np.linalg.norm(cam.up)
    right = np.cross(forward, up)
    rel = points - cam.pos
    depth, x, y = rel @ forward, rel @ right, rel @ up
    half = cam.frustum_width or 0.5 * aspect * (cam.frustum_top - cam.frustum_bottom)
    with np.errstate(divide="ignore", invalid="ignore"):
        sx, sy = x * cam.frustum_near / depth, y * cam.frustum_near / depth
    return ((depth >= cam.frustum_near) & (depth <= cam.frustum_far)
            & (sx >= cam.frustum_center - half) & (sx <= cam.frustum_center + half)
            & (sy >= cam.frustum_bottom) & (sy <= cam.frustum_top))


@pytest.mark.parametrize("seed", range(4))
def test_a_sphere_with_a_point_in_view_is_never_culled(seed):
    rng = np.random.default_rng(seed)
    forward = rng.normal(size=3)
    forward /= np.linalg.norm(forward)
    up = np.cross(forward, rng.normal(size=3))
    up /= np.linalg.norm(up)
    cam = camera(pos=rng.normal(size=3), forward=forward, up=up, near=0.05, far=6.0, top=0.04,
                 center=rng.uniform(-0.01, 0.01))
    aspect = rng.uniform(0.5, 2.0)
    centers = cam.pos + rng.uniform(-4, 4, size=(300, 3))
    radii = rng.uniform(0.01, 0.8, size=300)
    kept = spheres_in_frustum(centers, radii, frustum_half_spaces(cam, aspect))
    directions = rng.normal(size=(2000, 3))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    offsets = directions * rng.uniform(0, 1, size=(2000, 1)) ** (1 / 3)  # uniform in the unit ball
    seen = np.array([point_in_frustum(c + r * offsets, cam, aspect).any() for c, r in zip(centers, radii)])
    assert seen.any() and (~kept).any()  # both kinds occur: the check below can fail
    assert not (seen & ~kept).any(), np.flatnonzero(seen & ~kept)


def test_seen_through_a_mirror_hand_cases():
    eye = np.zeros(3)
    mirror = np.array([2.0, 0.0, 0.0])  # radius 0.5: the cone's half-angle is asin(0.25)
    centers = np.array([[4.0, 0.0, 0.0], [4.0, 2.0, 0.0], [4.0, 1.0, 0.0], [-3.0, 0.0, 0.0], [0.1, 0.0, 0.0]])
    radii = np.array([0.1, 0.1, 0.5, 0.1, 0.2])
    # on the axis; 26.6 deg off (cone 14.5); 14.0 deg off minus its own 6.4 deg; behind the eye; around the eye
    assert spheres_seen_through(centers, radii, eye, mirror, 0.5).tolist() == [True, False, True, False, True]
    assert spheres_seen_through(centers, radii, eye, mirror, 2.5).all()  # the eye inside the mirror's sphere


def check_culled_pixels_equal_robosuite(backend: str, suite: str, task_id: int, image_size: int) -> None:
    """Shared with the EGL test (tests/envs/test_gpu_render.py): three states, reflections on and off."""
    from envs.libero_env import LiberoEnv
    from envs.render_culling import set_frustum_culling
    from envs.render_options import apply_render_options
    from envs.suites import get_task

    env = LiberoEnv(get_task(suite, task_id), image_size=image_size, step_mode="lean", render_backend=backend,
                    render_culling=False)
    rng = np.random.default_rng(task_id)
    culled_any = False
    try:
        env.begin_episode(0, seed=0)
        scene_samples = env.libero_env.sim.model.vis.quality.offsamples
        context = env.libero_env.sim._render_context_offscreen
        for state in range(3):
            for _ in range(12 * state):
                env.control_step(rng.uniform(-0.6, 0.6, 7))
            for reflections in (True, False):
                apply_render_options(env.libero_env, reflections, scene_samples)
                set_frustum_culling(env.libero_env, False)
                expected = env.observation(render=True)
                full = context.scn.ngeom
                set_frustum_culling(env.libero_env, True)
                culled = env.observation(render=True)
                culled_any |= context.scn.ngeom < full  # the wrist camera's scene (rendered last)
                for key in expected:
                    np.testing.assert_array_equal(culled[key], expected[key],
                                                  err_msg=f"{suite} task {task_id} state {state} {key} "
                                                          f"reflections {reflections}")
        assert culled_any, f"{suite} task {task_id}: culling left every geom in: the check proves nothing"
    finally:
        env.close()


@pytest.mark.libero
@pytest.mark.parametrize("suite, task_id", [("libero_10", 2), ("libero_spatial", 0), ("libero_object", 3),
                                            ("libero_goal", 5), ("libero_90", 20)])
def test_culled_render_equals_robosuite_render_osmesa(suite, task_id):
    check_culled_pixels_equal_robosuite("auto", suite, task_id, image_size=128)


SYNTHETIC_SCENE = """
<mujoco>
  <visual><global offwidth="160" offheight="120"/><quality offsamples="0"/></visual>
  <asset>
    <material name="mirror" reflectance="0.6" rgba="0.3 0.3 0.3 1"/>
    <material name="floor" reflectance="0.3" rgba="0.5 0.5 0.6 1"/>
  </asset>
  <worldbody>
    <light pos="0 0 5" dir="0 0 -1" castshadow="false"/>
    <geom type="plane" size="0 0 1" material="floor"/>
    <geom type="box" pos="0.3 0.2 0.5" euler="20 10 0" size="0.6 0.4 0.15" material="mirror"/>
    {bodies}
    <camera name="a" pos="0 -2.5 1.2" xyaxes="1 0 0 0 0.5 1" fovy="40"/>
    <camera name="b" pos="2 0.5 0.8" xyaxes="-0.3 1 0 -0.3 0 1" fovy="60"/>
  </worldbody>
</mujoco>"""


@pytest.mark.libero  # mujoco and a GL backend (OSMesa on CPU machines)
def test_culled_render_keeps_an_infinite_planes_grid():
    """MuJoCo lays out an infinite plane from the scene's camera as the previous render left it; the
    culled render must leave that camera alone until the scene update (rendering a, then b)."""
    import importlib

    from envs.rendering import configure_gl

    backend = configure_gl("auto")
    import mujoco

    # the backend's own context class: `mujoco.GLContext` is fixed when mujoco is first imported, which in a
    # whole test session happens before any test chooses a backend
    gl_context = importlib.import_module(f"mujoco.{backend}").GLContext

    from envs.render_culling import culled_render

    rng = np.random.default_rng(0)
    bodies = "".join(
        f'<body pos="{x:.2f} {y:.2f} {z:.2f}"><geom type="box" size="0.1 0.15 0.2" rgba="{r:.2f} 0.4 0.7 1"/></body>'
        for x, y, z, r in rng.uniform([-3, -3, 0.1, 0], [3, 3, 2, 1], size=(40, 4)))
    model = mujoco.MjModel.from_xml_string(SYNTHETIC_SCENE.format(bodies=bodies))
    data = mujoco.MjData(model)
    mujoco.mj_forward(model, data)
    gl = gl_context(160, 120)
    gl.make_current()
    try:
        con = mujoco.MjrContext(model, mujoco.mjtFontScale.mjFONTSCALE_150)
        mujoco.mjr_setBuffer(mujoco.mjtFramebuffer.mjFB_OFFSCREEN, con)
        context = SimpleNamespace(model=SimpleNamespace(_model=model, vis=model.vis), data=SimpleNamespace(_data=data),
                                  con=con, scn=mujoco.MjvScene(model, maxgeom=200), vopt=mujoco.MjvOption(),
                                  pert=mujoco.MjvPerturb(), cam=mujoco.MjvCamera(),
                                  update_offscreen_size=lambda *size: None)
        viewport = mujoco.MjrRect(0, 0, 160, 120)

        def pixels() -> np.ndarray:
            image = np.empty((120, 160, 3), dtype=np.uint8)
            mujoco.mjr_readPixels(image, None, viewport, con)
            return image

        def plain(camera_id: int) -> np.ndarray:  # robosuite's render
            context.cam.type, context.cam.fixedcamid = mujoco.mjtCamera.mjCAMERA_FIXED, camera_id
            mujoco.mjv_updateScene(model, data, context.vopt, context.pert, context.cam, mujoco.mjtCatBit.mjCAT_ALL,
                                   context.scn)
            mujoco.mjr_render(viewport, context.scn, con)
            return pixels()

        culled_any = False
        for reflections in (1, 0):
            context.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = reflections
            for first, second in ((0, 1), (1, 0)):
                plain(first)
                expected, full = plain(second), context.scn.ngeom
                plain(first)
                culled_render(context, 160, 120, camera_id=second)
                culled_any |= context.scn.ngeom < full
                np.testing.assert_array_equal(pixels(), expected, err_msg=f"camera {second} after {first}")
        assert culled_any
    finally:
        gl.free()
