"""MJCF edits that make the reach scene cheap to render (envs/reach_scene.py applies them).

Pure functions on the scene's XML element tree (robosuite keeps MJCF as `xml.etree` elements),
applied before MuJoCo compiles it; no MuJoCo or robosuite import. Under OSMesa (software
rasterisation) a frame costs what its triangles and passes cost, not its pixels, and building a
render context uploads every mesh and texture; measured on the 2-core box (2 cameras, 64 px):
robosuite's Panda-on-a-table scene 140-160 ms per frame pair, ~100 ms less without reflections
(the table legs' reflective material re-renders the scene), ~8 ms with the edits below.

Physics is untouched: collision geoms, bodies, joints, inertials and actuators stay as they are.
Visual geoms never carry mass here (robosuite compiles with inertiagrouprange="0 0" and every
Panda body has an explicit <inertial>), and every geom robosuite knows by name is kept, because
its bookkeeping looks them up: a visual geom that is no longer drawn becomes a hidden 1 mm sphere
without a mesh.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np

VISIBLE_GROUP = 1  # robosuite renders geom group 1 (visual) and hides group 0 (collision)
HIDDEN_GROUP = 3  # off in MuJoCo's default MjvOption.geomgroup; robosuite never turns it on
ARM_GREY = (0.7, 0.7, 0.7, 1.0)  # between the Panda's white shells and its dark joints
ARM_PREFIXES = ("robot0_", "gripper0_")
MOUNT_PREFIX = "mount0_"
# How the reach scene is drawn: these edits with the arm's collision meshes, these edits with its
# visual meshes, or robosuite's scene unchanged (the reference look; physics is the same).
VISUALS = ("low_poly", "full_meshes", "robosuite")


def look_at_xyaxes(position, look_at) -> np.ndarray:
    """MuJoCo camera `xyaxes` (image right, image up) for a camera at `position` looking at
    `look_at` with world z up (MuJoCo cameras look along their own -z axis)."""
    forward = np.subtract(look_at, position, dtype=np.float64)
    forward /= np.linalg.norm(forward)
    right = np.cross(forward, (0.0, 0.0, 1.0))
    right /= np.linalg.norm(right)
    up = np.cross(right, forward)
    return np.concatenate([right, up])


def aim_camera(worldbody: ET.Element, name: str, position, look_at) -> None:
    """Move the camera `name` (a child of worldbody) to `position`, looking at `look_at`."""
    camera = worldbody.find(f"./camera[@name='{name}']")
    if camera is None:
        raise ValueError(f"the scene has no camera {name!r} under <worldbody>")
    for key in ("quat", "euler", "axisangle", "xyaxes", "zaxis"):
        camera.attrib.pop(key, None)
    camera.set("pos", _fmt(position))
    camera.set("xyaxes", _fmt(look_at_xyaxes(position, look_at)))


def simplify_for_rendering(root: ET.Element, low_poly: bool) -> None:
    """Edit the whole model (`root` is the <mujoco> element):
    - the mount's visual geoms (the pedestal under the arm: 33k triangles) are not drawn;
    - `low_poly`: arm and gripper bodies that have collision meshes are drawn with those (convex
      hulls, 200-300 triangles per link) in `ARM_GREY` instead of their visual meshes (168k);
    - no textures, no reflections, no shadows (nor a shadow map: ~64 MB per env), no
      multisampling of offscreen frames;
    - meshes and textures nothing uses any more are dropped (MuJoCo compiles and uploads them)."""
    worldbody, asset = root.find("worldbody"), root.find("asset")
    for body in worldbody.iter("body"):
        name = body.get("name", "")
        geoms = body.findall("geom")
        if name.startswith(MOUNT_PREFIX):
            for geom in geoms:
                if is_visual(geom):
                    make_placeholder(geom)
        elif low_poly and name.startswith(ARM_PREFIXES):
            hulls = [g for g in geoms if not is_visual(g) and g.get("type") == "mesh"]
            if not hulls:
                continue
            for geom in geoms:
                if is_visual(geom) and geom.get("type") == "mesh":
                    make_placeholder(geom)
            for geom in hulls:
                body.append(drawn_copy(geom))
    for material in asset.findall("material"):
        material.attrib.pop("texture", None)  # 660-1181 px maps, invisible at 56 px
        material.set("reflectance", "0")
    for light in worldbody.iter("light"):
        light.set("castshadow", "false")
    prune_unused_assets(root)
    visual = root.find("visual")
    if visual is None:
        visual = ET.SubElement(root, "visual")
    quality = visual.find("quality")
    if quality is None:
        quality = ET.SubElement(visual, "quality")
    quality.set("offsamples", "0")
    quality.set("shadowsize", "0")  # no shadow map (MuJoCo's default 4096^2 costs ~64 MB per env)


def is_visual(geom: ET.Element) -> bool:
    """robosuite marks visual-only geoms with contype = conaffinity = 0."""
    return geom.get("contype") == "0" and geom.get("conaffinity") == "0"


def make_placeholder(geom: ET.Element) -> None:
    """Keep the named geom, draw nothing: a 1 mm sphere in a hidden group, no mesh/material."""
    for key in ("mesh", "material", "pos", "quat", "size", "fromto"):
        geom.attrib.pop(key, None)
    geom.set("type", "sphere")
    geom.set("size", "0.001")
    geom.set("group", str(HIDDEN_GROUP))


def drawn_copy(collision_geom: ET.Element) -> ET.Element:
    """A visual-only twin of a collision mesh geom (same mesh and pose), in the arm's grey."""
    copy = ET.Element("geom")
    for key in ("pos", "quat", "mesh"):
        if key in collision_geom.attrib:
            copy.set(key, collision_geom.get(key))
    copy.set("name", f"{collision_geom.get('name')}_drawn")
    copy.set("type", "mesh")
    copy.set("contype", "0")
    copy.set("conaffinity", "0")
    copy.set("group", str(VISIBLE_GROUP))
    copy.set("rgba", _fmt(ARM_GREY))
    return copy


def prune_unused_assets(root: ET.Element) -> None:
    """Drop meshes no geom uses and 2-D/cube textures no material uses."""
    asset = root.find("asset")
    used_meshes = {g.get("mesh") for g in root.iter("geom")}
    used_textures = {m.get("texture") for m in asset.findall("material")}
    for mesh in asset.findall("mesh"):
        if mesh.get("name") not in used_meshes:
            asset.remove(mesh)
    for texture in asset.findall("texture"):
        if texture.get("type") != "skybox" and texture.get("name") not in used_textures:
            asset.remove(texture)


def _fmt(values) -> str:
    return " ".join(f"{float(v):.6g}" for v in values)
