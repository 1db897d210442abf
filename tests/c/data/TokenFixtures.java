/* TokenFixtures.java - writes the Hadoop token storage ("Credentials") files
 * that tests/c/test_hadoop_token.c reads, with Hadoop's own classes, so the C
 * parser (csrc/hadoop_token.c) is checked against what Hadoop really writes.
 *
 * Regenerate (Java 17 single-file launch; the jars are Maven's, from
 * `make hadoop`), from the repository root:
 *
 *   java -cp "$(cat build/hadoop/classpath.txt)" tests/c/data/TokenFixtures.java tests/c/data
 *
 * It writes, into the directory given:
 *   tokens-writable.bin   Credentials, SerializedFormat.WRITABLE (version byte 0)
 *   tokens-protobuf.bin   the same Credentials, SerializedFormat.PROTOBUF (version byte 1)
 *   tokens-expected.txt   per token: alias, kind, service, Token.encodeToUrlString(),
 *                         and the decoded delegation-token identifier fields
 * The output is deterministic (fixed dates, passwords and identifiers), so
 * regenerating with the same Hadoop gives the same bytes.
 *
 * The Credentials hold three tokens and one secret key:
 *   hdfs  HDFS_DELEGATION_TOKEN for 127.0.0.1:8020, owner alice, renewer yarn
 *   kms   kms-dt for a KMS URI: a proxy user (realUser alice), a negative
 *         sequence number and multi-byte vlongs/vints
 *   blob  ember-test: a 300-byte identifier that is no delegation-token
 *         identifier, an empty password and an empty service (multi-byte lengths)
 */
import java.io.ByteArrayOutputStream;
import java.io.DataInputStream;
import java.io.DataOutputStream;
import java.io.File;
import java.io.FileInputStream;
import java.io.FileOutputStream;
import java.io.PrintWriter;
import java.nio.charset.StandardCharsets;
import java.util.Map;

import org.apache.hadoop.crypto.key.kms.KMSDelegationToken;
import org.apache.hadoop.hdfs.security.token.delegation.DelegationTokenIdentifier;
import org.apache.hadoop.io.Text;
import org.apache.hadoop.security.Credentials;
import org.apache.hadoop.security.token.Token;
import org.apache.hadoop.security.token.TokenIdentifier;
import org.apache.hadoop.security.token.delegation.AbstractDelegationTokenIdentifier;

public class TokenFixtures {
  private static byte[] pattern(int n, int seed) {
    byte[] b = new byte[n];
    for (int i = 0; i < n; i++) b[i] = (byte) (seed + i * 7);
    return b;
  }

  private static String dash(String s) { return s.isEmpty() ? "-" : s; }

  public static void main(String[] args) throws Exception {
    File dir = new File(args.length > 0 ? args[0] : ".");
    Credentials creds = new Credentials();

    DelegationTokenIdentifier hdfsId =
        new DelegationTokenIdentifier(new Text("alice"), new Text("yarn"), new Text(""));
    hdfsId.setIssueDate(1700000000000L);
    hdfsId.setMaxDate(1700604800000L);
    hdfsId.setSequenceNumber(42);
    hdfsId.setMasterKeyId(7);
    Token<DelegationTokenIdentifier> hdfs = new Token<>(hdfsId.getBytes(),
        "hdfs-password-0123456789".getBytes(StandardCharsets.UTF_8),
        new Text("HDFS_DELEGATION_TOKEN"), new Text("127.0.0.1:8020"));
    creds.addToken(new Text("hdfs"), hdfs);

    KMSDelegationToken.KMSDelegationTokenIdentifier kmsId =
        new KMSDelegationToken.KMSDelegationTokenIdentifier();
    kmsId.setOwner(new Text("bob"));
    kmsId.setRenewer(new Text(""));
    kmsId.setRealUser(new Text("alice"));
    kmsId.setIssueDate(-1L);
    kmsId.setMaxDate(Long.MAX_VALUE);
    kmsId.setSequenceNumber(-5);
    kmsId.setMasterKeyId(300000);
    Token<KMSDelegationToken.KMSDelegationTokenIdentifier> kms =
        new Token<>(kmsId.getBytes(), pattern(150, 3), new Text("kms-dt"),
            new Text("kms://http@kms.example.com:9600/kms"));
    creds.addToken(new Text("kms"), kms);

    byte[] blobId = pattern(300, 1); /* first byte 1: not delegation-token version 0 */
    Token<TokenIdentifier> blob =
        new Token<>(blobId, new byte[0], new Text("ember-test"), new Text(""));
    creds.addToken(new Text("blob"), blob);

    creds.addSecretKey(new Text("ember.test.secret"), pattern(20, 9));

    for (Credentials.SerializedFormat f : Credentials.SerializedFormat.values()) {
      String name = f == Credentials.SerializedFormat.WRITABLE ? "tokens-writable.bin"
                                                               : "tokens-protobuf.bin";
      File out = new File(dir, name);
      try (DataOutputStream os = new DataOutputStream(new FileOutputStream(out))) {
        creds.writeTokenStorageToStream(os, f);
      }
      /* Hadoop reads it back to the same tokens */
      Credentials back = new Credentials();
      try (DataInputStream in = new DataInputStream(new FileInputStream(out))) {
        back.readTokenStorageStream(in);
      }
      if (back.numberOfTokens() != 3 || back.numberOfSecretKeys() != 1)
        throw new IllegalStateException(name + " did not read back");
      for (Map.Entry<Text, Token<? extends TokenIdentifier>> e : creds.getTokenMap().entrySet())
        if (!back.getToken(e.getKey()).equals(e.getValue()))
          throw new IllegalStateException(name + ": token " + e.getKey() + " differs");
    }

    try (PrintWriter w = new PrintWriter(new File(dir, "tokens-expected.txt"), "UTF-8")) {
      w.println("# written by TokenFixtures.java; '-' stands for an empty string");
      ByteArrayOutputStream def = new ByteArrayOutputStream();
      creds.writeTokenStorageToStream(new DataOutputStream(def));
      w.println("# default writeTokenStorageToStream format: version byte " + def.toByteArray()[4]);
      for (String alias : new String[] {"hdfs", "kms", "blob"}) {
        Token<? extends TokenIdentifier> t = creds.getToken(new Text(alias));
        w.println("token " + alias + " " + t.getKind() + " " + dash(t.getService().toString())
            + " " + t.encodeToUrlString());
        if (!alias.equals("blob")) {
          AbstractDelegationTokenIdentifier id =
              alias.equals("hdfs") ? hdfsId : kmsId;
          AbstractDelegationTokenIdentifier check =
              alias.equals("hdfs") ? new DelegationTokenIdentifier()
                                   : new KMSDelegationToken.KMSDelegationTokenIdentifier();
          check.readFields(
              new DataInputStream(new java.io.ByteArrayInputStream(t.getIdentifier())));
          if (!check.equals(id)) throw new IllegalStateException(alias + " identifier differs");
          w.println("ident " + alias + " " + dash(id.getOwner().toString()) + " "
              + dash(id.getRenewer().toString()) + " " + dash(id.getRealUser().toString()) + " "
              + id.getIssueDate() + " " + id.getMaxDate() + " " + id.getSequenceNumber() + " "
              + id.getMasterKeyId());
        }
      }
    }
  }
}
