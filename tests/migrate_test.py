"""`python -m tf2sync.migrate`: the constructs it finds in real TF1 shapes.

The programs in tests/testdata/migrate/ reproduce the shape of TensorFlow's
mnist_replica.py, the TF models' inception_distributed_train.py, a
MonitoredTrainingSession trainer with SyncReplicasOptimizer's hook, three
optimizers sharing one global step, and a plain single-machine program.
Each expected finding is located by the text of its line (so the test
checks the line independently of the tool), and the tool must report
exactly those: every construct, nothing invented.
"""

import io
import os
import re
import subprocess
import sys
import tempfile

from absl.testing import absltest

from tf2sync._src.migrate import cli
from tf2sync._src.migrate import finder
from tf2sync._src.migrate import table

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DATA = os.path.join(_ROOT, "tests", "testdata", "migrate")


def _path(name):
    return os.path.join(_DATA, name)


def _source(name):
    with open(_path(name)) as f:
        return f.read()


def _line(source, text, n=1, offset=0):
    """The line of the `n`-th line whose stripped text starts with `text`."""
    found = [
        i
        for i, line in enumerate(source.splitlines(), start=1)
        if line.strip().startswith(text)
    ]
    if len(found) < n:
        raise AssertionError(f"{text!r}: {len(found)} lines, wanted {n}")
    return found[n - 1] + offset


def _expected(source, rows):
    """{(line, construct name)} for rows of (name, text[, n[, offset]])."""
    return {(_line(source, *row[1:]), row[0]) for row in rows}


def _found(source):
    return {(f.line, f.name) for f in finder.find(source)}


def _run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


_FLAG = "cluster flag"
_CHIEF = "is_chief branch"

_MNIST_REPLICA = [
    (_FLAG, 'flags.DEFINE_integer("task_index"'),
    (_FLAG, 'flags.DEFINE_integer("replicas_to_aggregate"'),
    (_FLAG, 'flags.DEFINE_boolean("sync_replicas"'),
    (_FLAG, 'flags.DEFINE_boolean("existing_servers"'),
    (_FLAG, 'flags.DEFINE_string("worker_grpc_url"'),
    (_FLAG, 'flags.DEFINE_string("ps_hosts"'),
    (_FLAG, 'flags.DEFINE_string("worker_hosts"'),
    (_FLAG, 'flags.DEFINE_string("job_name"'),
    ("ClusterSpec", "cluster = tf.train.ClusterSpec("),
    ("Server", "server = tf.train.Server("),
    (_CHIEF, "is_chief = (FLAGS.task_index == 0)"),
    ("replica_device_setter", "tf.train.replica_device_setter("),
    ("global_step", 'global_step = tf.Variable(0, name="global_step"'),
    ("SyncReplicasOptimizer", "opt = tf.train.SyncReplicasOptimizer("),
    ("local_step_init_op", "local_init_op = opt.local_step_init_op"),
    (_CHIEF, "if is_chief:", 1),
    ("chief_init_op", "local_init_op = opt.chief_init_op"),
    ("ready_for_local_init_op", "ready_for_local_init_op = opt.ready_for"),
    ("get_chief_queue_runner", "chief_queue_runner = opt.get_chief_queue"),
    ("get_init_tokens_op", "sync_init_op = opt.get_init_tokens_op()"),
    ("Supervisor", "sv = tf.train.Supervisor(", 1),
    ("Supervisor", "sv = tf.train.Supervisor(", 2),
    (_CHIEF, "if is_chief:", 2),
    ("prepare_or_wait_for_session", "sess = sv.prepare_or_wait_for", 1),
    ("prepare_or_wait_for_session", "sess = sv.prepare_or_wait_for", 2),
    (_CHIEF, "if FLAGS.sync_replicas and is_chief:"),
    ("start_queue_runners", "sv.start_queue_runners(sess, [chief_queue"),
    ("sess.run loop", "_, step = sess.run([train_step, global_step]"),
]

_INCEPTION = [
    (_FLAG, "tf.app.flags.DEFINE_string('job_name'"),
    (_FLAG, "tf.app.flags.DEFINE_string('ps_hosts'"),
    (_FLAG, "tf.app.flags.DEFINE_string('worker_hosts'"),
    # `tf.app.flags.DEFINE_integer(` on the line before the name.
    (_FLAG, "'task_id', 0,", 1, -1),
    (_FLAG, "tf.app.flags.DEFINE_integer('num_replicas_to_aggregate'"),
    (_CHIEF, "is_chief = (FLAGS.task_id == 0)"),
    ("global_step", "global_step = slim.variables.global_step()"),
    (_CHIEF, "if is_chief:", 1),
    ("SyncReplicasOptimizer", "opt = tf.train.SyncReplicasOptimizer("),
    ("get_chief_queue_runner", "chief_queue_runners = [opt.get_chief_"),
    ("get_init_tokens_op", "init_tokens_op = opt.get_init_tokens_op()"),
    ("Supervisor", "sv = tf.train.Supervisor("),
    ("prepare_or_wait_for_session", "sess = sv.prepare_or_wait_for_session"),
    ("start_queue_runners", "sv.start_queue_runners(sess, queue_runners)"),
    (_CHIEF, "if is_chief:", 2),
    ("start_queue_runners", "sv.start_queue_runners(sess, chief_queue"),
    ("sess.run loop", "loss_value, step = sess.run([train_op, global_step])"),
    (_CHIEF, "if is_chief and next_summary_time < time.time():"),
    (_CHIEF, "if is_chief:", 3),
    (_CHIEF, "if is_chief:", 4),
    ("ClusterSpec", "cluster_spec = tf.train.ClusterSpec("),
    ("Server", "server = tf.train.Server("),
]

_MONITORED = [
    ("ClusterSpec", "cluster = tf.train.ClusterSpec("),
    ("Server", "server = tf.train.Server("),
    (_CHIEF, "is_chief = FLAGS.task_index == 0"),
    ("replica_device_setter", "with tf.device(tf.train.replica_device_"),
    ("global_step", "global_step = tf.train.get_or_create_global_step()"),
    ("SyncReplicasOptimizer", "opt = tf.train.SyncReplicasOptimizer("),
    ("make_session_run_hook", "sync_hook = opt.make_session_run_hook("),
    ("StopAtStepHook", "hooks = [sync_hook, StopAtStepHook("),
    ("MonitoredTrainingSession", "with tf.train.MonitoredTrainingSession("),
    ("sess.run loop", "mon_sess.run(train_op)"),
    (_FLAG, 'parser.add_argument("--ps_hosts"'),
    (_FLAG, 'parser.add_argument("--worker_hosts"'),
    (_FLAG, 'parser.add_argument("--job_name"'),
    (_FLAG, 'parser.add_argument("--task_index"'),
    (_FLAG, 'parser.add_argument("--replicas-to-aggregate"'),
]

_THREE = [
    ("ClusterSpec", "cluster = tf.train.ClusterSpec("),
    ("Server", "server = tf.distribute.Server("),
    ("replica_device_setter", "with tf.device(tf.compat.v1.train.replica"),
    ("global_step", "global_step = tf.compat.v1.train.get_or_create_global"),
    ("SyncReplicasOptimizer", "opt_a = SyncReplicasOptimizer("),
    ("SyncReplicasOptimizer", "opt_b = SyncReplicasOptimizer("),
    ("SyncReplicasOptimizer", "opt_c = SyncReplicasOptimizer("),
    (_CHIEF, "if is_chief:"),
    ("make_session_run_hook", "hooks = [o.make_session_run_hook(True)"),
    ("make_session_run_hook", "hooks = [o.make_session_run_hook(False)"),
    ("MonitoredTrainingSession", "with tf.compat.v1.train.MonitoredTrain"),
    ("sess.run loop", "session.run(update)"),
]


class RealProgramsTest(absltest.TestCase):
    def _check(self, name, rows):
        source = _source(name)
        expected = _expected(source, rows)
        self.assertLen(expected, len(rows), "two rows name one finding")
        self.assertEqual(_found(source), expected)

    def test_mnist_replica(self):
        self._check("mnist_replica.py", _MNIST_REPLICA)

    def test_inception_distributed_train(self):
        self._check("inception_distributed_train.py", _INCEPTION)

    def test_monitored_training_session_with_sync_hook(self):
        self._check("monitored_sync.py", _MONITORED)

    def test_three_optimizers_share_one_global_step(self):
        self._check("three_optimizers.py", _THREE)
        names = [f.name for f in finder.find(_source("three_optimizers.py"))]
        self.assertEqual(names.count("SyncReplicasOptimizer"), 3)
        self.assertEqual(names.count("global_step"), 1)

    def test_a_hook_given_num_tokens_is_kept(self):
        # Dropping it would start the run with TF1's default tokens
        # (compat_v1_programs_test's monitored ports: one round apart).
        found = finder.find(
            "import tensorflow as tf\n"
            "opt = tf.train.SyncReplicasOptimizer(inner, 2)\n"
            "h = opt.make_session_run_hook(is_chief, num_tokens=0)\n"
            "g = opt.make_session_run_hook(True, 0)\n"
            "d = opt.make_session_run_hook(is_chief)\n"
        )
        hooks = [
            (f.line, f.form) for f in found if f.name == "make_session_run_hook"
        ]
        self.assertEqual(
            hooks,
            [
                (3, table.HOOK_WITH_TOKENS),
                (4, table.HOOK_WITH_TOKENS),
                (5, table.BY_NAME["make_session_run_hook"].form),
            ],
        )

    def test_plain_program_has_nothing(self):
        # A session, a global step, a sess.run loop, MonitoredTraining-
        # Session, StopAtStepHook and a --num_workers flag (input threads):
        # single-machine TF1, nothing to report.
        self.assertEqual(finder.find(_source("plain_mnist.py")), [])
        code, out, err = _run(_path("plain_mnist.py"))
        self.assertEqual((code, err), (0, ""))
        self.assertEqual(
            out,
            "python -m tf2sync.migrate: no distributed-TF1 constructs in "
            "1 file\n",
        )

    def test_each_construct_of_the_table_is_found_somewhere(self):
        found = set()
        for name in os.listdir(_DATA):
            found |= {f.name for f in finder.find(_source(name))}
        found |= {f.name for f in finder.find(_ALIASES)}
        self.assertEqual(found, {c.name for c in table.CONSTRUCTS})


# Other spellings, one construct per marked line (`# -> name`).
_ALIASES = """\
import tensorflow.compat.v1 as tf1
from tensorflow.compat import v1 as tfv1
from tensorflow.train import Server as TFServer
from tensorflow.python.training import sync_replicas_optimizer as sro
from tensorflow.contrib import framework as contrib_framework
from absl import flags
import argparse

tr = tf1.train
flags.DEFINE_list("worker_hosts", [], "workers")  # -> cluster flag
flags.DEFINE_integer(name="num_ps_tasks", default=1)  # -> cluster flag
parser = argparse.ArgumentParser()
parser.add_argument("--task-index", type=int)  # -> cluster flag
server = TFServer(None)  # -> Server
spec = tfv1.train.ClusterSpec({})  # -> ClusterSpec
setter = tr.replica_device_setter(ps_tasks=2)  # -> replica_device_setter
opt = sro.SyncReplicasOptimizer(inner, 2,  # -> SyncReplicasOptimizer
                                replica_id=0)  # -> replica_id
step = contrib_framework.get_or_create_global_step()  # -> global_step
gs = tf1.get_variable("global_step", [], trainable=False)  # -> global_step
self.global_step = tf1.Variable(0, trainable=False)  # -> global_step
hook = tf1.train.StopAtStepHook(last_step=10)  # -> StopAtStepHook
sv = tfv1.train.Supervisor(is_chief=True)  # -> Supervisor
with sv.managed_session() as s:  # -> prepare_or_wait_for_session
    while True:
        s.run(train_op)  # -> sess.run loop
if self._is_chief:  # -> is_chief branch
    pass
role = "chief" if is_chief else "worker"  # -> is_chief branch
while task_index == 0:  # -> is_chief branch
    break
"""

# Near misses: none of these is a distributed construct.
_NOT_FOUND = """\
import tensorflow as tf

tf.train.start_queue_runners(sess=sess)
coord = tf.train.Coordinator()
sv = make_supervisor(ready_for_local_init_op=op, local_init_op=op2)
self.chief_init_op = build()
sess.run(train_op)
for batch in data:
    sess.run(loss)
    sess.run(summary_op, feed_dict={x: batch})
    optimizer.run(train_op)
    def later():
        sess.run(train_op)
if chief:
    pass
if task_index == 1:
    pass
tf.train.get_global_step()
counter = tf.Variable(0, trainable=False)
steps = tf.Variable(0, name="global_step")
parser.add_argument("--num_layers")
flags.DEFINE_string("protocol", "grpc", "")
"""


class SpellingTest(absltest.TestCase):
    def test_aliases_and_other_spellings(self):
        expected = {
            (i, line.rsplit("# -> ", 1)[1])
            for i, line in enumerate(_ALIASES.splitlines(), start=1)
            if "# -> " in line
        }
        self.assertEqual(_found(_ALIASES), expected)

    def test_near_misses_are_not_reported(self):
        # One real construct so that the program counts as distributed.
        source = _NOT_FOUND + "tf.train.Server(cluster)\n"
        last = len(source.splitlines())
        self.assertEqual(_found(source), {(last, "Server")})
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "one.py")
            with open(path, "w") as f:
                f.write(source)
            code, out, _ = _run(path)
        self.assertEqual(code, 0)
        self.assertEqual(
            out.splitlines()[-1],
            "python -m tf2sync.migrate: 1 construct in 1 file: Server 1",
        )

    def test_weak_flags_alone_are_not_distributed(self):
        source = (
            "parser.add_argument('--num_workers')\n"
            "flags.DEFINE_string('master', '', '')\n"
            "global_step = tf.train.get_or_create_global_step()\n"
        )
        self.assertEqual(_found(source), set())
        source += "flags.DEFINE_string('job_name', '', '')\n"
        self.assertEqual(
            {name for _, name in _found(source)}, {_FLAG, "global_step"}
        )
        self.assertLen(_found(source), 4)

    def test_cluster_flags_name_their_own_counterpart(self):
        (f,) = finder.find("flags.DEFINE_boolean('sync_replicas', 0, '')\n")
        self.assertEqual(f.form, table.FLAG_FORMS["sync_replicas"])
        self.assertIn("--sync_optimizer=tf1_shim", f.form)
        (f,) = finder.find("flags.DEFINE_integer('task_id', 0, '')\n")
        self.assertIn("`--task_index`", f.form)


class CommandTest(absltest.TestCase):
    def test_output_lines_and_summary(self):
        path = _path("mnist_replica.py")
        code, out, err = _run(path)
        self.assertEqual((code, err), (0, ""))
        lines = out.splitlines()
        self.assertLen(lines, len(_MNIST_REPLICA) + 1)
        server = _line(_source("mnist_replica.py"), "server = tf.train.Server(")
        self.assertIn(
            f"{path}:{server}: tf.train.Server -> "
            f"{table.BY_NAME['Server'].form} "
            "(docs/migrating.md#cluster-servers-and-roles)",
            lines,
        )
        for line in lines[:-1]:
            self.assertRegex(
                line,
                rf"^{re.escape(path)}:\d+: .+ -> .+ "
                r"\(docs/migrating\.md#[\w-]+\)$",
            )
        self.assertEqual(
            lines[-1],
            "python -m tf2sync.migrate: 28 constructs in 1 file: Server 1, "
            "ClusterSpec 1, replica_device_setter 1, SyncReplicasOptimizer 1, "
            "get_chief_queue_runner 1, get_init_tokens_op 1, chief_init_op 1, "
            "local_step_init_op 1, ready_for_local_init_op 1, Supervisor 2, "
            "prepare_or_wait_for_session 2, start_queue_runners 1, "
            "sess.run loop 1, is_chief branch 4, cluster flag 8, "
            "global_step 1",
        )

    def test_several_programs(self):
        code, out, _ = _run(
            _path("three_optimizers.py"), _path("plain_mnist.py")
        )
        self.assertEqual(code, 0)
        self.assertIn(
            "python -m tf2sync.migrate: 12 constructs in 2 files: ",
            out.splitlines()[-1],
        )

    def _refused(self, argv, message):
        code, out, err = _run(*argv)
        self.assertEqual(code, 2)
        self.assertEqual(out, "")
        self.assertEqual(err.count("\n"), 1, err)
        self.assertEqual(err, f"python -m tf2sync.migrate: error: {message}\n")

    def test_missing_file(self):
        self._refused(
            [_path("mnist_replica.py"), "no/such.py"],
            "PROGRAM 'no/such.py': no such file",
        )

    def test_syntax_error_names_the_line(self):
        with tempfile.TemporaryDirectory() as tmp:
            bad = os.path.join(tmp, "py2.py")
            with open(bad, "w") as f:
                f.write("import tensorflow as tf\n\nprint 'hello'\n")
            code, _, err = _run(bad)
            self.assertEqual(code, 2)
            self.assertTrue(
                err.startswith(
                    f"python -m tf2sync.migrate: error: PROGRAM {bad!r} is "
                    "not valid Python: line 3: "
                ),
                err,
            )
            self.assertEqual(err.count("\n"), 1)
            # TF's own mnist_replica.py had `elif:` at one commit.
            with open(bad, "w") as f:
                f.write("if a:\n  b = 1\nelif:\n  c = 2\n")
            code, _, err = _run(bad)
            self.assertEqual(code, 2)
            self.assertIn("is not valid Python: line 3: ", err)
            with open(bad, "wb") as f:
                f.write(b"x = '\xff\xfe'\n")
            code, _, err = _run(bad)
            self.assertEqual(code, 2)
            self.assertIn(f"PROGRAM {bad!r} is not valid Python", err)
            self.assertEqual(err.count("\n"), 1)

    def test_directory_no_program_and_options(self):
        self._refused(
            [_DATA], f"PROGRAM {_DATA!r} is a directory, not a program"
        )
        code, _, err = _run()
        self.assertEqual(code, 2)
        self.assertIn("error: no PROGRAM given (usage: ", err)
        code, _, err = _run("--fix", _path("mnist_replica.py"))
        self.assertEqual(code, 2)
        self.assertIn("error: unknown option '--fix'", err)
        code, out, _ = _run("--help")
        self.assertEqual(code, 0)
        self.assertIn("usage: python -m tf2sync.migrate PROGRAM.py", out)

    def test_python_dash_m(self):
        env = dict(os.environ, PYTHONPATH=_ROOT)
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "tf2sync.migrate",
                _path("monitored_sync.py"),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn("15 constructs in 1 file", run.stdout.splitlines()[-1])
        run = subprocess.run(
            [sys.executable, "-m", "tf2sync.migrate", "missing.py"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        self.assertEqual(run.returncode, 2)
        self.assertEqual(
            run.stderr.splitlines()[-1],
            "python -m tf2sync.migrate: error: PROGRAM 'missing.py': "
            "no such file",
        )


def _slug(heading):
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


class DocTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        with open(os.path.join(_ROOT, table.DOC)) as f:
            self.doc = f.read()

    def test_doc_holds_the_tools_table(self):
        self.assertIn(table.markdown_table(), self.doc)

    def test_every_anchor_is_a_section(self):
        anchors = {_slug(m) for m in re.findall(r"^#+ (.+)$", self.doc, re.M)}
        for c in table.CONSTRUCTS:
            self.assertIn(c.anchor, anchors, c.name)

    def test_doc_shows_the_command(self):
        self.assertIn("python -m tf2sync.migrate", self.doc)

    def test_doc_quotes_what_the_tool_prints_for_mnist_replica(self):
        # The walk-through's output block, run from the repository's root.
        command = (
            "$ python -m tf2sync.migrate "
            + "tests/testdata/migrate/mnist_replica.py"
        )
        block = re.search(re.escape(command) + r"\n(.*?)\n```", self.doc, re.S)
        self.assertIsNotNone(block, command)
        out = io.StringIO()
        self.assertEqual(cli.main([_path("mnist_replica.py")], out=out), 0)
        printed = out.getvalue().replace(_ROOT + os.sep, "")
        self.assertEqual(block.group(1), printed.rstrip("\n"))


if __name__ == "__main__":
    absltest.main()
