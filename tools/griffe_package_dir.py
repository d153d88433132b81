"""A Griffe extension for the API reference (mkdocs.yml): the package as setup.py maps it.

Griffe reads the sources without importing them and finds a package's sub-packages among
its folder's sub-folders. `tfx_gradient_accumulator`'s folder, `src/tfx_gradient_accumulator/`,
holds only its `__init__.py`; setup.py's `package_dir` maps `.accumulator`, `.components`
and `.pipelines` to the repository's top-level folders. When Griffe has read the
package's `__init__.py`, this loads each of those folders and makes it the package's
member, so `::: tfx_gradient_accumulator.accumulator.optimizer.GradientAccumulator`
resolves, under that name only.
"""

import pathlib

import griffe

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "tfx_gradient_accumulator"
INSTALLED = ("accumulator", "components", "pipelines")   # setup.py's INSTALLED


class PackageDir(griffe.Extension):
    def on_module_members(self, *, node, mod, agent, **kwargs):
        if mod.path != PACKAGE:
            return
        loader = griffe.GriffeLoader(search_paths=[str(ROOT)], extensions=agent.extensions,
                                     docstring_parser=agent.docstring_parser,
                                     docstring_options=agent.docstring_options,
                                     lines_collection=agent.lines_collection,
                                     modules_collection=agent.modules_collection, allow_inspection=False)
        for folder in INSTALLED:
            module = loader.load(folder)
            # Loaded as a top-level module into the shared collection (where its aliases
            # resolve); it lives on only as the package's member.
            agent.modules_collection.del_member(folder)
            mod.set_member(folder, module)
