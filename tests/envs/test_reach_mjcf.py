"""The reach scene's MJCF edits (envs/reach_mjcf.py) on small hand-written models: pure XML, no
MuJoCo needed."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np
import pytest

from envs import reach_mjcf

SCENE = """
<mujoco>
  <asset>
    <texture name="tex-used" type="2d" file="a.png"/>
    <texture name="tex-unused" type="2d" file="b.png"/>
    <texture name="sky" type="skybox" builtin="gradient" width="8" height="8"/>
    <material name="shiny" texture="tex-used" reflectance="0.8"/>
    <mesh name="link1" file="link1.stl"/>
    <mesh name="link1_vis" file="link1_vis.obj"/>
    <mesh name="pedestal" file="pedestal.stl"/>
    <mesh name="orphan" file="orphan.stl"/>
  </asset>
  <worldbody>
    <light name="sun" castshadow="true"/>
    <camera name="agentview" pos="1 0 1" quat="1 0 0 0"/>
    <body name="mount0_base">
      <geom name="mount0_pedestal_vis" type="mesh" mesh="pedestal" contype="0" conaffinity="0" group="1"/>
      <geom name="mount0_pedestal_col" type="cylinder" size="0.1 0.2"/>
    </body>
    <body name="robot0_link1">
      <inertial pos="0 0 0" mass="1" diaginertia="1 1 1"/>
      <geom name="robot0_link1_vis" type="mesh" mesh="link1_vis" material="shiny"
            contype="0" conaffinity="0" group="1"/>
      <geom name="robot0_link1_collision" type="mesh" mesh="link1" pos="0 0 0.1" group="0"/>
    </body>
    <body name="table">
      <geom name="table_visual" type="box" size="1 1 0.1" material="shiny" contype="0" conaffinity="0" group="1"/>
    </body>
  </worldbody>
</mujoco>
"""


def _scene(low_poly: bool = True) -> ET.Element:
    root = ET.fromstring(SCENE)
    reach_mjcf.simplify_for_rendering(root, low_poly=low_poly)
    return root


def _geom(root: ET.Element, name: str) -> ET.Element:
    found = root.find(f".//geom[@name='{name}']")
    assert found is not None, name
    return found


def test_low_poly_draws_collision_meshes_and_hides_visual_meshes_keeping_names():
    root = _scene(low_poly=True)
    visual = _geom(root, "robot0_link1_vis")
    assert visual.get("type") == "sphere" and visual.get("group") == str(reach_mjcf.HIDDEN_GROUP)
    assert "mesh" not in visual.attrib and "material" not in visual.attrib
    drawn = _geom(root, "robot0_link1_collision_drawn")
    assert drawn.get("mesh") == "link1" and drawn.get("pos") == "0 0 0.1"
    assert drawn.get("group") == str(reach_mjcf.VISIBLE_GROUP)
    assert drawn.get("contype") == "0" and drawn.get("conaffinity") == "0"
    collision = _geom(root, "robot0_link1_collision")
    assert collision.attrib == {"name": "robot0_link1_collision", "type": "mesh", "mesh": "link1",
                                "pos": "0 0 0.1", "group": "0"}  # physics geom untouched


def test_without_low_poly_the_arm_keeps_its_visual_meshes():
    root = _scene(low_poly=False)
    assert _geom(root, "robot0_link1_vis").get("mesh") == "link1_vis"
    assert root.find(".//geom[@name='robot0_link1_collision_drawn']") is None


def test_mount_textures_reflections_shadows_multisampling_and_unused_assets():
    root = _scene()
    assert _geom(root, "mount0_pedestal_vis").get("group") == str(reach_mjcf.HIDDEN_GROUP)
    assert _geom(root, "mount0_pedestal_col").get("type") == "cylinder"
    material = root.find("asset/material")
    assert "texture" not in material.attrib and material.get("reflectance") == "0"
    assert root.find(".//light").get("castshadow") == "false"
    quality = root.find("visual/quality")
    assert quality.get("offsamples") == "0" and quality.get("shadowsize") == "0"
    assert {m.get("name") for m in root.findall("asset/mesh")} == {"link1"}
    assert {t.get("name") for t in root.findall("asset/texture")} == {"sky"}


def test_aim_camera_points_the_camera_at_the_target():
    root = ET.fromstring(SCENE)
    worldbody = root.find("worldbody")
    position, target = (0.45, 0.0, 1.30), (-0.10, 0.2, 0.98)
    reach_mjcf.aim_camera(worldbody, "agentview", position, target)
    camera = worldbody.find("camera")
    assert "quat" not in camera.attrib
    axes = np.array([float(v) for v in camera.get("xyaxes").split()]).reshape(2, 3)
    np.testing.assert_allclose(axes @ axes.T, np.eye(2), atol=1e-5)  # orthonormal
    look = -np.cross(axes[0], axes[1])  # MuJoCo cameras look along their -z = -(x cross y)
    expected = np.subtract(target, position) / np.linalg.norm(np.subtract(target, position))
    np.testing.assert_allclose(look, expected, atol=1e-5)
    assert axes[0][2] == pytest.approx(0.0, abs=1e-6)  # image right stays horizontal: no roll
    with pytest.raises(ValueError, match="no camera 'frontview'"):
        reach_mjcf.aim_camera(worldbody, "frontview", position, target)
