package ember.spark;

import java.io.BufferedInputStream;
import java.io.BufferedOutputStream;
import java.io.ByteArrayInputStream;
import java.io.DataInputStream;
import java.io.DataOutputStream;
import java.io.EOFException;
import java.io.File;
import java.io.IOException;
import java.io.RandomAccessFile;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.NoSuchElementException;
import java.util.concurrent.ArrayBlockingQueue;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.ConcurrentLinkedDeque;

import org.apache.arrow.memory.BufferAllocator;
import org.apache.arrow.vector.FieldVector;
import org.apache.arrow.vector.VectorSchemaRoot;
import org.apache.arrow.vector.ipc.ArrowStreamReader;
import org.apache.spark.SparkEnv;
import org.apache.spark.TaskContext;
import org.apache.spark.TaskContext$;
import org.apache.spark.api.java.JavaRDD;
import org.apache.spark.api.java.function.FlatMapFunction;
import org.apache.spark.api.python.PythonUtils;
import org.apache.spark.sql.Dataset;
import org.apache.spark.sql.Row;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.catalyst.expressions.JoinedRow;
import org.apache.spark.sql.catalyst.expressions.UnsafeArrayData;
import org.apache.spark.sql.catalyst.expressions.UnsafeRow;
import org.apache.spark.sql.catalyst.util.ArrayData;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.ArrowUtils$;
import org.apache.spark.sql.vectorized.ArrowColumnVector;
import org.apache.spark.sql.vectorized.ColumnVector;
import org.apache.spark.sql.vectorized.ColumnarBatch;
import org.apache.spark.unsafe.Platform;

import scala.Tuple2;

/**
 * EmberModel.transform's direct path: the executor JVM writes the model's
 * input columns of each batch of rows, as packed little-endian values, down a
 * pipe to an Ember inference worker (a Python process, {@code python -m
 * ember._direct_launcher <the model it started for> <runtime>}, which has
 * the worker forked with its runtime imported, one per concurrent
 * task, kept and reused by later tasks, of the same model or, loading it, of
 * another), and appends the output columns it sends back (one Arrow IPC batch
 * per input batch) to the rows.
 *
 * <p>Why not Spark's Arrow UDF path: Spark's row-to-Arrow writer handles an
 * {@code array<float>} one element at a time, and its UDF operator copies
 * each input row through a queue and two projections.  Here a row's array
 * values go to the pipe as one copy from the row's own memory.
 *
 * <p>Input column kinds, chosen on the driver (ember.ml):
 * {@code a:<bytes per value>:<values per row>:<f|i>} a fixed-length array of
 * float/double/int/bigint; {@code b:<bytes per row>} a tensor column
 * (binary, fixed length); {@code s:<bytes per value>:<f|i>} a number.
 */
public final class DirectInference {
  private DirectInference() {}

  static final int MAGIC = 0x454d4231;  // "EMB1"
  /** A row count asking an idle worker to answer (status 0, no body). */
  static final int PING = -1;
  /** A row count telling an idle worker to serve another model: its spec follows. */
  static final int LOAD = -2;

  /** The DataFrame {@code df} plus the model's output columns. */
  public static Dataset<Row> transform(Dataset<Row> df, String[] columns, String[] kinds,
                                       byte[] spec, String specKey, String runtime, String label,
                                       String outputSchemaJson, String pythonExec, int batchSize) {
    StructType in = df.schema();
    StructType out = (StructType) DataType.fromJson(outputSchemaJson);
    int[] ordinals = new int[columns.length];
    for (int i = 0; i < columns.length; i++) {
      ordinals[i] = in.fieldIndex(columns[i]);
    }
    Partition fn = new Partition(columns, kinds, ordinals, spec, specKey, runtime, label,
                                 pythonExec, Math.max(1, batchSize));
    JavaRDD<InternalRow> mapped = Plans.rows(df).toJavaRDD().mapPartitions(fn);
    return Plans.frame(df, mapped.rdd(), out);
  }

  /** One column's packing into the pipe. */
  static final class Column {
    final String name;
    final char kind;
    final int ordinal;
    final int valueBytes;   // a: bytes per array element; s: bytes per number
    final int width;        // a: values per row
    final int rowBytes;     // bytes per row in the pipe
    final boolean floating; // a, s: float/double values (else integers)

    Column(String name, String kind, int ordinal) {
      this.name = name;
      this.ordinal = ordinal;
      String[] p = kind.split(":");
      this.kind = p[0].charAt(0);
      switch (this.kind) {
        case 'a':
          valueBytes = Integer.parseInt(p[1]);
          width = Integer.parseInt(p[2]);
          rowBytes = valueBytes * width;
          floating = p[3].equals("f");
          break;
        case 'b':
          valueBytes = 1;
          width = Integer.parseInt(p[1]);
          rowBytes = width;
          floating = false;
          break;
        case 's':
          valueBytes = Integer.parseInt(p[1]);
          width = 1;
          rowBytes = valueBytes;
          floating = p[2].equals("f");
          break;
        default:
          throw new IllegalArgumentException("ember: unknown column kind " + kind);
      }
    }
  }

  /** The per-partition function (serialized to the executors). */
  static final class Partition implements FlatMapFunction<Iterator<InternalRow>, InternalRow> {
    private static final long serialVersionUID = 1L;
    final String[] names;
    final String[] kinds;
    final int[] ordinals;
    final byte[] spec;
    final String specKey;
    final String runtime;
    final String label;
    final String pythonExec;
    final int batchSize;

    Partition(String[] names, String[] kinds, int[] ordinals, byte[] spec, String specKey,
              String runtime, String label, String pythonExec, int batchSize) {
      this.names = names;
      this.kinds = kinds;
      this.ordinals = ordinals;
      this.spec = spec;
      this.specKey = specKey;
      this.runtime = runtime;
      this.label = label;
      this.pythonExec = pythonExec;
      this.batchSize = batchSize;
    }

    @Override
    public Iterator<InternalRow> call(Iterator<InternalRow> input) throws Exception {
      Column[] cols = new Column[names.length];
      for (int i = 0; i < cols.length; i++) {
        cols[i] = new Column(names[i], kinds[i], ordinals[i]);
      }
      TaskContext task = TaskContext.get();
      Worker worker = Worker.borrow(pythonExec, runtime, specKey, label, spec, gpus(task));
      return new Results(task, worker, cols, input, batchSize);
    }
  }

  /**
   * The GPU addresses Spark assigned to this task ({@code spark.task.resource.gpu.amount}),
   * comma-separated; "" when it has none.
   */
  static String gpus(TaskContext task) {
    if (task == null) {
      return "";
    }
    scala.Option<org.apache.spark.resource.ResourceInformation> gpu = task.resources().get("gpu");
    return gpu.isDefined() ? String.join(",", gpu.get().addresses()) : "";
  }

  /** A batch of input rows (copies) waiting for their outputs, or the end. */
  static final class Pending {
    final InternalRow[] rows;
    final int n;
    final Throwable failure;

    Pending(InternalRow[] rows, int n, Throwable failure) {
      this.rows = rows;
      this.n = n;
      this.failure = failure;
    }
  }

  /**
   * Output rows of one task.  A writer thread packs batches into the worker's
   * pipe while this iterator reads the outputs of earlier batches, so the
   * JVM's packing and the model's work overlap.
   */
  static final class Results implements Iterator<InternalRow> {
    final TaskContext task;
    final Worker worker;
    final BlockingQueue<Pending> pending = new ArrayBlockingQueue<>(2);
    final Thread writer;
    final BufferAllocator allocator;
    final JoinedRow joined = new JoinedRow();
    final String where;
    volatile boolean finished;
    Pending batch;
    int next;
    ColumnarBatch outputs;
    ArrowStreamReader reader;
    boolean done;

    Results(TaskContext task, Worker worker, Column[] cols, Iterator<InternalRow> input,
            int batchSize) {
      this.task = task;
      this.worker = worker;
      this.where = "partition " + (task == null ? "?" : task.partitionId());
      this.allocator = ArrowUtils$.MODULE$.rootAllocator()
          .newChildAllocator("ember-direct-" + where, 0, Long.MAX_VALUE);
      this.writer = new Thread(() -> write(task, cols, input, batchSize), "ember direct writer " + where);
      writer.setDaemon(true);
      if (task != null) {
        task.addTaskCompletionListener((org.apache.spark.util.TaskCompletionListener) ctx -> close());
      }
      writer.start();
    }

    private void write(TaskContext task, Column[] cols, Iterator<InternalRow> input, int batchSize) {
      if (task != null) {
        TaskContext$.MODULE$.setTaskContext(task);
      }
      long row = 0;
      try {
        DataOutputStream out = worker.out;
        byte[] scalars = new byte[8];
        while (input.hasNext() && !finished) {
          InternalRow[] rows = new InternalRow[batchSize];
          int n = 0;
          while (n < batchSize && input.hasNext()) {
            rows[n++] = input.next().copy();
          }
          out.writeInt(n);
          for (Column c : cols) {
            for (int i = 0; i < n; i++) {
              pack(out, c, rows[i], row + i, scalars);
            }
          }
          out.flush();
          row += n;
          hand(new Pending(rows, n, null));
        }
        out.writeInt(0);  // end of this task's rows; the worker waits for the next task
        out.flush();
        hand(new Pending(null, 0, null));
      } catch (Throwable t) {
        try {
          hand(new Pending(null, 0, t));
        } catch (InterruptedException e) {
          Thread.currentThread().interrupt();
        }
      }
    }

    /** Queues a batch for the reading side, unless the task has ended meanwhile. */
    private void hand(Pending p) throws InterruptedException {
      while (!finished) {
        if (pending.offer(p, 100, java.util.concurrent.TimeUnit.MILLISECONDS)) {
          return;
        }
      }
    }

    private void pack(DataOutputStream out, Column c, InternalRow r, long row, byte[] scalar)
        throws IOException {
      if (r.isNullAt(c.ordinal)) {
        throw new IllegalArgumentException("column '" + c.name + "' is null at row " + row
            + " of " + where + "; the model needs a value in every row");
      }
      switch (c.kind) {
        case 'a': {
          ArrayData a = r.getArray(c.ordinal);
          if (a.numElements() != c.width) {
            throw new IllegalArgumentException("column '" + c.name + "' row " + row + " of "
                + where + " has " + a.numElements() + " values; the model takes " + c.width);
          }
          if (a instanceof UnsafeArrayData) {
            UnsafeArrayData u = (UnsafeArrayData) a;
            long header = UnsafeArrayData.calculateHeaderPortionInBytes(c.width);
            Object base = u.getBaseObject();
            long offset = u.getBaseOffset();
            for (long w = 8; w < header; w += 8) {  // the null bits
              if (Platform.getLong(base, offset + w) != 0) {
                throw new IllegalArgumentException("column '" + c.name + "' row " + row + " of "
                    + where + " holds a null value");
              }
            }
            if (base instanceof byte[]) {
              out.write((byte[]) base, (int) (offset + header - Platform.BYTE_ARRAY_OFFSET), c.rowBytes);
              return;
            }
          }
          for (int i = 0; i < c.width; i++) {
            if (a.isNullAt(i)) {
              throw new IllegalArgumentException("column '" + c.name + "' row " + row + " of "
                  + where + " holds a null value");
            }
          }
          byte[] bytes = new byte[c.rowBytes];
          copyValues(a, c, bytes);
          out.write(bytes);
          return;
        }
        case 'b': {
          if (r instanceof UnsafeRow) {
            UnsafeRow u = (UnsafeRow) r;
            long offsetAndSize = u.getLong(c.ordinal);
            int size = (int) offsetAndSize;
            if (size == c.rowBytes && u.getBaseObject() instanceof byte[]) {
              out.write((byte[]) u.getBaseObject(),
                  (int) (u.getBaseOffset() + (offsetAndSize >> 32) - Platform.BYTE_ARRAY_OFFSET), size);
              return;
            }
          }
          byte[] b = r.getBinary(c.ordinal);
          if (b.length != c.rowBytes) {
            throw new IllegalArgumentException("tensor column '" + c.name + "' row " + row + " of "
                + where + " has " + b.length + " bytes; the model takes " + c.rowBytes);
          }
          out.write(b);
          return;
        }
        default: {
          long bits;
          if (c.floating) {
            bits = c.valueBytes == 4 ? Float.floatToRawIntBits(r.getFloat(c.ordinal))
                                     : Double.doubleToRawLongBits(r.getDouble(c.ordinal));
          } else {
            bits = c.valueBytes == 4 ? r.getInt(c.ordinal) : r.getLong(c.ordinal);
          }
          for (int i = 0; i < c.valueBytes; i++) {
            scalar[i] = (byte) (bits >>> (8 * i));
          }
          out.write(scalar, 0, c.valueBytes);
        }
      }
    }

    private static void copyValues(ArrayData a, Column c, byte[] bytes) {
      java.nio.ByteBuffer b = java.nio.ByteBuffer.wrap(bytes).order(java.nio.ByteOrder.LITTLE_ENDIAN);
      for (int i = 0; i < c.width; i++) {
        switch (c.valueBytes) {
          case 4:
            b.putInt(i * 4, c.floating ? Float.floatToRawIntBits(a.getFloat(i)) : a.getInt(i));
            break;
          default:
            b.putLong(i * 8, c.floating ? Double.doubleToRawLongBits(a.getDouble(i)) : a.getLong(i));
        }
      }
    }

    @Override
    public boolean hasNext() {
      while (!done && (batch == null || next >= batch.n)) {
        advance();
      }
      return !done;
    }

    @Override
    public InternalRow next() {
      if (!hasNext()) {
        throw new NoSuchElementException();
      }
      int i = next++;
      return joined.apply(batch.rows[i], outputs.getRow(i));
    }

    private void advance() {
      releaseOutputs();
      if (task != null) {
        task.killTaskIfInterrupted();  // a killed task stops between batches
      }
      Pending p;
      try {
        p = pending.take();
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        throw new RuntimeException("ember: interrupted waiting for " + where, e);
      }
      if (p.failure != null) {
        worker.broken = true;
        throw failure(p.failure);
      }
      if (p.rows == null) {
        done = true;
        finished = true;
        worker.release();
        return;
      }
      try {
        byte[] ipc = worker.readReply(where);
        reader = new ArrowStreamReader(new ByteArrayInputStream(ipc), allocator);
        if (!reader.loadNextBatch()) {
          throw new IOException("ember inference worker sent no output batch");
        }
        VectorSchemaRoot root = reader.getVectorSchemaRoot();
        if (root.getRowCount() != p.n) {
          throw new IOException("ember inference worker sent " + root.getRowCount()
              + " output rows for " + p.n + " input rows");
        }
        List<FieldVector> vs = root.getFieldVectors();
        ColumnVector[] cv = new ColumnVector[vs.size()];
        for (int i = 0; i < cv.length; i++) {
          cv[i] = new ArrowColumnVector(vs.get(i));
        }
        outputs = new ColumnarBatch(cv, p.n);
      } catch (IOException e) {
        worker.broken = true;
        throw failure(e);
      }
      batch = p;
      next = 0;
    }

    private RuntimeException failure(Throwable t) {
      if (t instanceof RuntimeException) {
        return (RuntimeException) t;
      }
      return new RuntimeException("ember direct inference, " + where + ": " + t.getMessage(), t);
    }

    private void releaseOutputs() {
      if (reader != null) {
        try {
          reader.close();
        } catch (IOException e) {
          // the batch's buffers are freed either way
        }
        reader = null;
        outputs = null;
      }
    }

    void close() {
      finished = true;
      releaseOutputs();
      if (!done) {
        // the task ended early (a limit, a failure): the pipe is mid-batch
        worker.broken = true;
        writer.interrupt();
        worker.release();
      }
      allocator.close();
    }
  }

  /**
   * An inference worker process and its pipes.  Idle workers wait for the
   * next task: one of the model they hold if there is one, else of any model
   * of the same runtime (TensorFlow or TorchScript), which the worker then
   * loads in place of its own (a process's start and its framework's import,
   * seconds, are paid once per concurrent task, not once per model: a
   * cross-validator's or a pipeline's models share the workers).  One idle
   * longer than {@code EMBER_DIRECT_IDLE_SECONDS} (default 60, as Spark's
   * Python workers) is stopped, and at most as many stay idle as this
   * executor has had tasks at once (a model's memory each).  A task given
   * GPUs gets a worker started with exactly those visible
   * ({@code CUDA_VISIBLE_DEVICES}): workers are pooled per runtime and GPU
   * set, so a model loaded on one GPU never serves a task given another.
   */
  static final class Worker {
    static final Map<String, ConcurrentLinkedDeque<Worker>> IDLE = new ConcurrentHashMap<>();
    static final long IDLE_NANOS = java.util.concurrent.TimeUnit.SECONDS.toNanos(
        Long.parseLong(System.getenv().getOrDefault("EMBER_DIRECT_IDLE_SECONDS", "60")));
    static final java.util.concurrent.atomic.AtomicInteger ACTIVE =
        new java.util.concurrent.atomic.AtomicInteger();
    static final java.util.concurrent.atomic.AtomicInteger PEAK =
        new java.util.concurrent.atomic.AtomicInteger(1);
    static final java.util.concurrent.ScheduledExecutorService REAPER =
        java.util.concurrent.Executors.newSingleThreadScheduledExecutor(r -> {
          Thread t = new Thread(r, "ember direct worker reaper");
          t.setDaemon(true);
          return t;
        });

    static {
      REAPER.scheduleWithFixedDelay(() -> reap(0), 5, 5, java.util.concurrent.TimeUnit.SECONDS);
    }

    final String key;
    /** The spec key of the model this worker holds. */
    String loaded;
    final Process process;
    final DataOutputStream out;
    final DataInputStream in;
    final File errors;
    volatile boolean broken;

    Worker(String key, String loaded, Process process, File errors) {
      this.key = key;
      this.loaded = loaded;
      this.process = process;
      this.errors = errors;
      this.out = new DataOutputStream(new BufferedOutputStream(process.getOutputStream(), 1 << 20));
      this.in = new DataInputStream(new BufferedInputStream(process.getInputStream(), 1 << 16));
    }

    static Worker borrow(String pythonExec, String runtime, String specKey, String label,
        byte[] spec, String gpus) throws IOException {
      String key = pythonExec + "\u0000" + runtime + "\u0000" + gpus;
      PEAK.accumulateAndGet(ACTIVE.incrementAndGet(), Math::max);
      ConcurrentLinkedDeque<Worker> idle = IDLE.computeIfAbsent(key, k -> new ConcurrentLinkedDeque<>());
      for (Worker w : idle) {  // one holding this model first
        if (w.loaded.equals(specKey) && idle.remove(w)) {
          if (w.answers()) {
            return w;
          }
          w.stop();
        }
      }
      for (Worker w; (w = idle.pollFirst()) != null; ) {
        if (w.answers() && w.load(spec, specKey)) {
          return w;
        }
        w.stop();
      }
      Worker w = null;
      try {
        w = start(key, specKey, pythonExec, runtime, label, gpus);
        w.out.writeInt(MAGIC);
        w.out.writeInt(spec.length);
        w.out.write(spec);
        w.out.flush();
        return w;
      } catch (IOException | RuntimeException e) {
        ACTIVE.decrementAndGet();
        if (w != null) {
          String tail = w.errorTail();
          w.stop();
          throw new IOException("ember: the inference worker (" + pythonExec
              + " -m ember._direct_launcher) did not start: " + e.getMessage() + "\n" + tail, e);
        }
        throw new IOException("ember: cannot start " + pythonExec
            + " -m ember._direct_launcher: " + e.getMessage(), e);
      }
    }

    static Worker start(String key, String specKey, String pythonExec, String runtime,
        String label, String gpus) throws IOException {
      ProcessBuilder pb = new ProcessBuilder(pythonExec, "-m", "ember._direct_launcher", label,
          runtime);
      Map<String, String> env = pb.environment();
      SparkEnv spark = SparkEnv.get();
      String userPath = env.getOrDefault("PYTHONPATH", "");
      if (spark != null) {
        scala.collection.Iterator<Tuple2<String, String>> it = spark.conf().getExecutorEnv().iterator();
        while (it.hasNext()) {
          Tuple2<String, String> kv = it.next();
          if (kv._1().equals("PYTHONPATH")) {
            userPath = kv._2() + (userPath.isEmpty() ? "" : File.pathSeparator + userPath);
          } else {
            env.put(kv._1(), kv._2());
          }
        }
        if (!env.containsKey("OMP_NUM_THREADS")) {
          env.put("OMP_NUM_THREADS", spark.conf().get("spark.task.cpus", "1"));
        }
      }
      // what Spark's Python workers also get: files of sc.addPyFile / --py-files
      String files = org.apache.spark.SparkFiles.getRootDirectory();
      File[] shipped = new File(files).listFiles(
          f -> f.getName().endsWith(".zip") || f.getName().endsWith(".egg"));
      StringBuilder more = new StringBuilder(files);
      if (shipped != null) {
        for (File f : shipped) {
          more.append(File.pathSeparator).append(f.getAbsolutePath());
        }
      }
      userPath = more + (userPath.isEmpty() ? "" : File.pathSeparator + userPath);
      String sparkPath = PythonUtils.sparkPythonPath();
      env.put("PYTHONPATH", sparkPath + (userPath.isEmpty() ? "" : File.pathSeparator + userPath));
      if (!gpus.isEmpty()) {
        // CUDA numbers GPUs fastest first unless told PCI bus order, which is
        // nvidia-smi's and so the discovery scripts' (the addresses Spark gives)
        env.put("CUDA_VISIBLE_DEVICES", gpus);
        env.put("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
      }
      File errors = File.createTempFile("ember-direct-worker-", ".log");
      errors.deleteOnExit();
      pb.redirectError(ProcessBuilder.Redirect.to(errors));
      return new Worker(key, specKey, pb.start(), errors);
    }

    /**
     * Hands this idle worker another model's spec; it loads the model before
     * its next batch, and a model that fails to load fails that batch, as at
     * a worker's start.  False if the pipe is closed.
     */
    boolean load(byte[] spec, String specKey) {
      try {
        out.writeInt(LOAD);
        out.writeInt(spec.length);
        out.write(spec);
        out.flush();
      } catch (IOException e) {
        return false;
      }
      loaded = specKey;
      return true;
    }

    /**
     * Whether an idle worker still answers.  One killed while idle (by the
     * kernel's OOM killer, a user) may still count as alive until the JVM
     * reaps it; the round trip finds it closed, so a task never starts on it.
     */
    boolean answers() {
      if (!process.isAlive()) {
        return false;
      }
      try {
        out.writeInt(PING);
        out.flush();
        return in.readInt() == 0 && in.readInt() == 0;
      } catch (IOException e) {
        return false;
      }
    }

    byte[] readReply(String where) throws IOException {
      int status;
      int len;
      byte[] body;
      try {
        status = in.readInt();
        len = in.readInt();
        body = new byte[len];
        in.readFully(body);
      } catch (EOFException e) {
        throw new IOException("the ember inference worker (" + where + ") exited"
            + exitText() + "; its last output:\n" + errorTail(), e);
      }
      if (status != 0) {
        broken = true;
        throw new IllegalArgumentException(new String(body, StandardCharsets.UTF_8));
      }
      return body;
    }

    private String exitText() {
      try {
        if (process.waitFor(2, java.util.concurrent.TimeUnit.SECONDS)) {
          return " with status " + process.exitValue();
        }
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
      }
      return "";
    }

    String errorTail() {
      try (RandomAccessFile f = new RandomAccessFile(errors, "r")) {
        long size = f.length();
        long from = Math.max(0, size - 4000);
        byte[] b = new byte[(int) (size - from)];
        f.seek(from);
        f.readFully(b);
        return new String(b, StandardCharsets.UTF_8);
      } catch (IOException e) {
        return "(no output: " + e.getMessage() + ")";
      }
    }

    long idleSince;

    /** Called once per borrow, when the task is done with the worker. */
    void release() {
      ACTIVE.decrementAndGet();
      if (broken || !process.isAlive()) {
        stop();
        return;
      }
      idleSince = System.nanoTime();
      IDLE.get(key).addFirst(this);
      reap(PEAK.get());
    }

    void stop() {
      process.destroyForcibly();
      errors.delete();
    }

    /** Stops idle workers past the idle time, then the longest idle beyond {@code keep} (0: no cap). */
    static synchronized void reap(int keep) {
      long now = System.nanoTime();
      List<Worker> idle = new ArrayList<>();
      for (ConcurrentLinkedDeque<Worker> q : IDLE.values()) {
        for (Worker w : q) {
          if (now - w.idleSince > IDLE_NANOS || !w.process.isAlive()) {
            if (q.remove(w)) {
              w.stop();
            }
          } else {
            idle.add(w);
          }
        }
      }
      if (keep > 0 && idle.size() > keep) {
        idle.sort((a, b) -> Long.compare(a.idleSince, b.idleSince));
        for (Worker w : idle.subList(0, idle.size() - keep)) {
          if (IDLE.get(w.key).remove(w)) {
            w.stop();
          }
        }
      }
    }
  }
}
